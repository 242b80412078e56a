"""Reliability suite: bounded by default; ``LORASYNC_SOAK=1`` also runs the long soaks
(``@pytest.mark.slow``). The measured figures are printed as a table after the run."""

from __future__ import annotations

import os

import pytest

from ._figures import FIGURES, FINDING_RUNS, table

SOAK = os.environ.get("LORASYNC_SOAK") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SOAK:
        return
    skip = pytest.mark.skip(reason="soak test: set LORASYNC_SOAK=1 to run it")
    for item in items:
        if "slow" in item.keywords and "reliability" in str(item.fspath):
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES or FINDING_RUNS:
        terminalreporter.write_line("")
        for line in table().splitlines():
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors, a busy 2-core box: torch's thread pool only adds contention.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
