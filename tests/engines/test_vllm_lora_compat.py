"""The worker extension's per-release rules (``engines/vllm/_lora_compat``) and the CUDA IPC stage
spec's ``on_gpu`` flag: what the H200 run of vLLM 0.26 needed, checked without vLLM.

vLLM 0.26 with LoRA on refuses a merged update of ``<module>.weight`` for a LoRA-wrapped layer
(``There is no module or parameter named 'layers.0.mlp.down_proj.weight' ... base_layer.weight``,
docs/benchmarks-gpu.md): the worker renames those weights on 0.26 and leaves 0.32's alone.
"""

from __future__ import annotations

import json

import pytest

from lorasync.engines.vllm import _lora_compat
from lorasync.engines.vllm._protocol import CudaStage
from lorasync.errors import ConfigError

WRAPPED = (
    "model.layers.0.self_attn.qkv_proj.base_layer.weight",
    "model.layers.0.mlp.gate_up_proj.base_layer.weight",
    "model.layers.0.mlp.down_proj.base_layer.weight",
    "model.layers.11.mlp.down_proj.base_layer.weight",
    "model.embed_tokens.weight",
    "model.layers.0.input_layernorm.weight",
)


class _Model:
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def named_parameters(self):
        return [(n, None) for n in WRAPPED]


@pytest.mark.parametrize(
    ("version", "mapper", "renames", "patterns"),
    [("0.26.0", "get_unstacked_mapper", True, False), ("0.29.1", "get_unstacked_mapper", True, False),
     ("0.32.0", "get_rename_mapper", False, True), ("0.33.0", "get_rename_mapper", False, True),
     ("0.10.1", "get_unstacked_mapper", True, False), (None, "get_unstacked_mapper", True, False)],
)  # fmt: skip
def test_rules_follow_the_newest_release_not_newer(version, mapper, renames, patterns) -> None:
    rules = _lora_compat.rules_for(version)
    assert (rules.mapper, rules.base_layer_names, rules.patterns) == (mapper, renames, patterns)


def test_merged_update_names_lora_wrapped_layers_by_their_base_layer() -> None:
    names = [
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.mlp.down_proj.weight",  # not wrapped (only layers 0 and 11 are here)
        "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
    ]  # fmt: skip
    out = _lora_compat.to_base_layer_names({n: i for i, n in enumerate(names)}, _Model())
    assert list(out) == [
        "model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.v_proj.base_layer.weight",
        "model.layers.0.mlp.up_proj.base_layer.weight", "model.layers.0.mlp.down_proj.base_layer.weight",
        "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
    ]  # fmt: skip
    assert list(out.values()) == list(range(len(names)))  # the tensors themselves, unchanged


def test_validators_the_release_lacks_are_skipped() -> None:
    seen = []

    class Manager:  # has one of 0.32's three checks
        def _validate_moe_lora_format(self, lora):
            seen.append(lora)

    _lora_compat.validate(_lora_compat.rules_for("0.32.0"), Manager(), "lora")
    _lora_compat.validate(_lora_compat.rules_for("0.26.0"), Manager(), "lora-026")
    assert seen == ["lora"]


def test_cuda_stage_on_gpu_round_trips_and_is_absent_by_default() -> None:
    spec = {"version": 1, "handle": "x"}
    assert "on_gpu" not in json.loads(CudaStage(token="t" * 32, ipc=spec).to_json())
    stage = CudaStage.from_json(CudaStage(token="t" * 32, ipc=spec, on_gpu=True).to_json())
    assert stage.on_gpu is True and dict(stage.ipc) == spec
    with pytest.raises(ConfigError, match="on_gpu"):
        CudaStage.from_json(json.dumps({**spec, "token": "t" * 32, "on_gpu": "yes"}))
