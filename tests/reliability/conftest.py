"""Reliability suite: bounded by default; ``LORASYNC_SOAK=1`` also runs the long soaks
(``@pytest.mark.slow``). The measured figures are printed as a table after the run (by
tests/conftest.py, which an xdist controller loads)."""

from __future__ import annotations

import os

import pytest

SOAK = os.environ.get("LORASYNC_SOAK") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SOAK:
        return
    skip = pytest.mark.skip(reason="soak test: set LORASYNC_SOAK=1 to run it")
    for item in items:
        if "slow" in item.keywords and "reliability" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors, a busy 2-core box: torch's thread pool only adds contention.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
