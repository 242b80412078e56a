"""The in-process PEFT engine passes the engine conformance suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lorasync.engines import Engine, connect
from lorasync.testing import EngineConformance


@pytest.fixture(scope="module")
def shared_engine(tiny_model_dir: Path) -> Iterator[Engine]:
    # One engine for the module: the suite cleans up after each test, so this also checks that
    # loads and unloads leave a long-lived engine usable.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls are far slower with 2 threads on a busy box
    with connect("peft", base_model_path=tiny_model_dir) as engine:
        yield engine
    torch.set_num_threads(threads)


class TestPeftEngineConformance(EngineConformance):
    @pytest.fixture
    def engine(self, shared_engine: Engine) -> Engine:
        return shared_engine
