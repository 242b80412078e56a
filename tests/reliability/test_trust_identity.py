"""What the hash-identity rule stands on (design invariant 8): engine instance ids and the sources
engines report for what they serve (``Engine.instance_id``, ``Engine.adapter_sources``)."""

from __future__ import annotations

import os

from lorasync import Adapter
from lorasync.engines import Engine
from lorasync.engines._engine import is_in_process_id
from lorasync.engines.peft import PeftEngine
from lorasync.engines.ray_actor import RayEngine
from lorasync.engines.vllm import VLLMEngine
from lorasync.exporters.fsdp import export
from lorasync.testing import MemoryEngine

from ._trust import trainer

def _adapter(base, seed: int) -> Adapter:
    return export(trainer(base, seed=seed))


def test_in_process_engines_are_unique_per_object_remote_ones_per_url(tiny_model_dir):
    a, b = PeftEngine(base_model_path=tiny_model_dir), PeftEngine(base_model_path=tiny_model_dir)
    assert a.instance_id != b.instance_id and a.instance_id == a.instance_id
    assert is_in_process_id(a.instance_id) and f":{os.getpid()}:" in a.instance_id
    assert MemoryEngine().instance_id != MemoryEngine().instance_id
    one, two = VLLMEngine("http://127.0.0.1:1"), VLLMEngine("http://127.0.0.1:1")
    try:
        assert one.instance_id == two.instance_id == "vllm:http://127.0.0.1:1" and not is_in_process_id(one.instance_id)
    finally:
        one.close()
        two.close()
    assert RayEngine.remote is True
    assert is_in_process_id("peft:")  # how records of older releases named in-process engines


def test_a_plugin_without_sources_says_it_cannot_tell():
    class Plugin(Engine):
        kind = "plugin"

    assert Plugin().adapter_sources() is None


def test_the_peft_engine_names_each_load(tiny_model_dir, tmp_path):
    engine = PeftEngine(base_model_path=tiny_model_dir)
    _adapter(tiny_model_dir, 1).save(tmp_path / "v1")
    engine.load_adapter("p@v1", tmp_path / "v1")
    engine.load_adapter_tensors("p@v2", _adapter(tiny_model_dir, 2))
    engine.load_adapter_tensors("p@v3", _adapter(tiny_model_dir, 2))
    sources = engine.adapter_sources()
    assert sources["p@v1"] == os.path.abspath(tmp_path / "v1")
    assert sources["p@v2"] != sources["p@v3"]  # identical tensors, two loads: two sources
    engine.replace_adapter_tensors("p@v2", _adapter(tiny_model_dir, 3))
    assert engine.adapter_sources()["p@v2"] not in (sources["p@v2"], sources["p@v3"])
    engine.unload_adapter("p@v1")
    assert set(engine.adapter_sources()) == {"p@v2", "p@v3"}
