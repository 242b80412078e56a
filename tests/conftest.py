"""Shared fixtures: a tiny local base model on disk (built once per session, no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory with the tiny GQA Llama (safetensors + tokenizer + config.json)."""
    from lorasync.testing import make_tiny_model

    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model(path)
    return path


# -- real vLLM server (tests marked @pytest.mark.vllm) --------------------------------------------


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM engine venv's python; skips (or fails with LORASYNC_REQUIRE_VLLM=1) when missing."""
    import os

    from lorasync.testing.vllm_server import vllm_python as find

    python = find()
    if not python.exists():
        message = (
            f"vLLM engine python {python} not found; run scripts/engine-venv.sh and set LORASYNC_VLLM_PYTHON"
        )
        if os.environ.get("LORASYNC_REQUIRE_VLLM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return python


@pytest.fixture(scope="session")
def vllm_server(vllm_python: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One real vLLM CPU server for the whole run, on the tiny model, served as ``tiny-base``:
    LoRA on (max rank 16, 4 slots), runtime updating on, dev mode on, lorasync's worker
    extension loaded (IPC and merged transports)."""
    from lorasync.testing.vllm_server import VLLMServer

    log = tmp_path_factory.mktemp("vllm-logs") / "vllm-main.log"
    with VLLMServer(
        tiny_model_dir,
        python=vllm_python,
        served_model_name="tiny-base",
        log_path=log,
        extra_args=("--worker-extension-cls", "lorasync.engines.vllm_worker.LoraSyncWorkerExtension"),
    ) as server:
        yield server
