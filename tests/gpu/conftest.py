"""GPU tests: every test here is marked ``gpu`` and skipped without a CUDA device (CI has none).

Run them on a GPU machine with ``python -m pytest tests/gpu -q``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from typing import Any
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from _vllm_setup import REHEARSAL

    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.gpu)
            # The real-vLLM tests (test_vllm_*_gpu.py) also run as a CPU rehearsal on request.
            rehearsed = REHEARSAL and Path(str(item.fspath)).name.startswith("test_vllm_")
            if not torch.cuda.is_available() and not rehearsed:
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

    def ask(self, *, errors_too: bool = False, **msg: object) -> dict:
        """Send one request and read its answer; one with ``error`` fails the test unless
        ``errors_too`` (the caller checks it)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"consumer exited with {self.proc.poll()}"
        answer = json.loads(line)
        assert errors_too or "error" not in answer, answer["error"]
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


# -- the real vLLM (tests/gpu/test_vllm_*_gpu.py) ------------------------------------------------


@pytest.fixture(scope="session")
def vllm_here() -> str:
    """vLLM's version in this python; skips when vLLM is not importable (CI, a bare GPU image:
    scripts/gpu-vllm-bundle.sh brings it to the H200)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM in this python (scripts/gpu-vllm-bundle.sh install, then PYTHONPATH)")
    if importlib.util.find_spec("flashinfer") is None:
        # vLLM's sampler imports FlashInfer unless told not to (the bundle leaves it out).
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import vllm

    return str(vllm.__version__)


@pytest.fixture(scope="session")
def qwen3_dir(vllm_here: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random-weight Qwen3 of the test shape (0.6B on the GPU), with its tokenizer."""
    from _vllm_setup import TEST_SHAPE, build_model_dir, qwen3_config

    return build_model_dir(tmp_path_factory.mktemp(f"qwen3-{TEST_SHAPE}"), qwen3_config(TEST_SHAPE))


def gpu_server(model: Path, log: Path, *, max_loras: int, max_cpu_loras: int, max_rank: int = 16, max_len: int = 4096, extra: tuple[str, ...] = ()):
    """A real vLLM OpenAI server on this machine's GPU (or the CPU build in the rehearsal)."""
    from _vllm_setup import DTYPE_NAME, REHEARSAL

    from lorasync.engines.vllm import WORKER_EXTENSION
    from lorasync.testing.vllm_server import VLLMServer

    args = ["--dtype", DTYPE_NAME, "--max-model-len", str(max_len), "--worker-extension-cls", WORKER_EXTENSION]
    if not REHEARSAL:
        args += ["--gpu-memory-utilization", "0.25", "--max-num-seqs", "32"]
    return VLLMServer(
        model, python=sys.executable, max_lora_rank=max_rank, max_loras=max_loras, max_cpu_loras=max_cpu_loras,
        served_model_name="base", log_path=log, extra_args=(*args, *extra), startup_timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="session")
def vllm_gpu_server(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One server for the exactness tests: 4 GPU slots, 8 cached adapters (no LRU eviction)."""
    log = Path(os.environ.get("OUT", str(tmp_path_factory.mktemp("vllm-logs")))) / "vllm-server.log"
    with gpu_server(qwen3_dir, log, max_loras=4, max_cpu_loras=8) as server:
        yield server
