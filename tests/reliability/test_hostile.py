"""Hostile names, versions, tensors and adapter directories are refused with typed errors before
anything reaches an engine or the store (see _hostile.py for the list)."""

from __future__ import annotations

import pytest

from lorasync import Adapter
from lorasync.errors import AdapterError, AdapterRejectedError
from lorasync.testing import MemoryEngine

from ._figures import record
from ._harness import tiny_adapter
from ._hostile import run_hostile


def test_every_hostile_input_is_refused_typed():
    result = run_hostile()
    record(hostile=result["tried"], hostile_rejected=result["rejected"])
    assert result["violations"] == [], "\n".join(result["violations"])
    assert result["rejected"] == result["tried"] > 100


def test_extra_safetensors_are_refused_by_load_and_engines(tmp_path):
    adapter = tiny_adapter(1)
    adapter.save(tmp_path)
    assert Adapter.load(tmp_path).content_hash == adapter.content_hash
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes((tmp_path / "adapter_model.safetensors").read_bytes())
    with pytest.raises(AdapterError, match="model-00001-of-00002.safetensors"):
        Adapter.load(tmp_path)
    with pytest.raises(AdapterRejectedError):
        MemoryEngine().load_adapter("p@v1", tmp_path)
