"""GPU tests: every test here is marked ``gpu`` and skipped without a CUDA device (CI has none).

Run them on a GPU machine with ``python -m pytest tests/gpu -q``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


class Consumer:
    """The second process (tests/gpu/_consumer.py), driven one JSON line at a time."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        environ = dict(os.environ, **(env or {}))
        environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), environ.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "_consumer.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=environ,
        )

    def ask(self, **msg: object) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"consumer exited with {self.proc.poll()}"
        answer = json.loads(line)
        assert "error" not in answer, answer["error"]
        return answer

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def consumer() -> Iterator[Consumer]:
    c = Consumer()
    yield c
    c.close()


@pytest.fixture
def cpu_consumer() -> Iterator[Consumer]:
    """A consumer that sees no GPU (like a vLLM CPU worker on the same host)."""
    c = Consumer(env={"CUDA_VISIBLE_DEVICES": ""})
    yield c
    c.close()
