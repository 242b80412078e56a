"""Megatron ↔ FSDP/PEFT for MoE LoRA: the same trained adapter, exported from Megatron-Bridge shards
and from the PEFT ``target_parameters`` model, is the same lorasync Adapter, bit for bit.

The PEFT side is a tiny random Qwen3-MoE with LoRA on attention (q/k/v sharing one lora_A, which
is what Megatron's fused ``linear_qkv`` adapter can express), the fused experts and the router;
``fsdp.export`` splits the experts. The Megatron side is that adapter written as Megatron-Bridge
rank shards by the independent spec builder (``_shard_builder``, from trainer-formats.md, never
from lorasync's exporters) in both expert layouts, sequential (``local_experts.{e}``) and grouped
(3-D per-expert ``GroupedExpertLinearAdapter``), at expert parallelism 1 and 2, then read back by
``megatron.export``. ``test_moe_bridge_peer_cross_check.py`` does the same from a real
Megatron-Bridge model.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from _shard_builder import build_shards

from lorasync.exporters import megatron
from lorasync.exporters.fsdp import export
from lorasync.testing import make_moe_peft_model, make_tiny_moe_model


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any]]:
    directory = tmp_path_factory.mktemp("tiny-moe")
    make_tiny_moe_model(directory)
    from transformers import AutoModelForCausalLM

    model = make_moe_peft_model(AutoModelForCausalLM.from_pretrained(str(directory)), r=8, alpha=16, seed=11, std=0.1)
    with torch.no_grad():  # fused Megatron LoRA has one lora_A for q, k and v
        for layer in model.base_model.model.model.layers:
            attn = layer.self_attn
            for proj in (attn.k_proj, attn.v_proj):
                proj.lora_A["default"].weight.copy_(attn.q_proj.lora_A["default"].weight)
    cfg = json.loads((directory / "config.json").read_text())
    # transformers 5.24 writes num_local_experts; the spec builder reads num_experts (lorasync reads both).
    return model, {**cfg, "num_experts": cfg.get("num_experts") or cfg["num_local_experts"]}


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("experts", ["sequential", "grouped"])
def test_megatron_export_equals_fsdp_export_bit_for_bit(trained: tuple[Any, dict[str, Any]], experts: str, ep: int) -> None:
    model, cfg = trained
    fsdp = export(model)
    assert sum(".mlp.experts." in m for m in fsdp.modules) == 2 * 4 * 3 and "model.layers.1.mlp.gate" in fsdp.modules
    shards = build_shards(dict(fsdp.tensors), cfg, ep=ep, experts=experts)
    names = {n for sd in shards.values() for n in sd}
    assert any(("local_experts" in n) == (experts == "sequential") for n in names if ".experts." in n)
    mega = megatron.export(shards, base_config=cfg, alpha=16, rank=8, ep_size=ep)
    assert sorted(mega.tensors) == sorted(fsdp.tensors)
    for key, tensor in fsdp.tensors.items():
        assert mega.tensors[key].dtype == tensor.dtype and torch.equal(mega.tensors[key], tensor), key
    assert (mega.config.r, mega.config.lora_alpha, dict(mega.config.rank_pattern)) == (fsdp.config.r, fsdp.config.lora_alpha, {})
    assert mega.config.target_modules == fsdp.config.target_modules
