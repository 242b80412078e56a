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
