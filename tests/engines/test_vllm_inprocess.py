"""The in-process vLLM engine (``connect("vllm-inprocess", llm=...)``), through the real vLLM.

vLLM lives in its own venv, so the scenario itself (``peer_vllm_inprocess.py``) runs there under
that venv's pytest, once with a ``vllm.LLM`` and once with an ``AsyncLLM``; this side makes the
adapters and PEFT's greedy tokens, the numerical reference the engine must match exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model, make_tiny_model

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ([5, 6, 7, 8], [100, 200, 300], [11, 12, 13, 14, 15, 16])
NEW_TOKENS = 8


def _greedy(model: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def data_file(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("inproc")
    adapters, expected = [], []
    for version, (seed, std) in enumerate(((1, 0.02), (7, 0.08), (11, 0.05)), start=1):
        model = make_peft_model(make_tiny_model(), r=8, seed=seed, std=std)
        adapters.append(str(export(model).save(root / f"v{version}")))
        expected.append([_greedy(model, p) for p in PROMPTS])
    # Distinct versions must be told apart by their tokens, or "serves v3" would prove nothing.
    assert len({json.dumps(e) for e in expected}) == 3
    rank32 = str(export(make_peft_model(make_tiny_model(), r=32, seed=3)).save(root / "rank32"))
    path = root / "data.json"
    path.write_text(
        json.dumps(
            {
                "model_dir": str(tiny_model_dir),
                "adapters": adapters,
                "expected": expected,
                "prompts": [list(p) for p in PROMPTS],
                "new_tokens": NEW_TOKENS,
                "rank32": rank32,
            }
        )
    )
    return path


def _run_peer(vllm_python: Path, data_file: Path, mode: str, tmp_path: Path, **extra: str) -> None:
    env = dict(os.environ, **extra)
    env.update(
        LORASYNC_INPROC_DATA=str(data_file),
        LORASYNC_INPROC_MODE=mode,
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB; the default takes a large share of RAM
    )
    cmd = [
        str(vllm_python), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "python_files=peer_*.py",
        "--basetemp", str(tmp_path / "peer"), str(REPO / "tests" / "engines" / "peer_vllm_inprocess.py"),
    ]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=1500)
    tail = (out.stdout + out.stderr)[-6000:]
    assert out.returncode == 0, tail
    assert " passed" in out.stdout and " failed" not in out.stdout, tail


def test_vllm_llm_in_process(vllm_python: Path, data_file: Path, tmp_path: Path) -> None:
    _run_peer(vllm_python, data_file, "llm", tmp_path)


def test_vllm_async_llm_in_process(vllm_python: Path, data_file: Path, tmp_path: Path) -> None:
    _run_peer(vllm_python, data_file, "async", tmp_path)


def test_vllm_llm_in_this_very_process(vllm_python: Path, data_file: Path, tmp_path: Path) -> None:
    """``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (verl's colocated rollout): the engine core and its
    worker run in the trainer's process, where CUDA IPC cannot map the trainer's own memory; the
    tensors are handed to the worker directly and served exactly."""
    _run_peer(vllm_python, data_file, "llm", tmp_path, VLLM_ENABLE_V1_MULTIPROCESSING="0")
