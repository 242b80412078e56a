"""PEFT adapter → Megatron shards (independent builder, from the spec) → export → the same tensors,
bit for bit, across TP/PP/EP layouts, GQA shapes, padding, CanonicalLoRA and MoE modes."""

from __future__ import annotations

import pytest
import torch
from _shard_builder import build_shards, config, make_peft

from lorasync.exporters.megatron import ShardKey, export


def _roundtrip(cfg, *, r=8, rank=None, lora_type="lora", experts="sequential", expert_down=True, **layout):
    peft = make_peft(
        cfg, r=r, seed=7, shared_a=lora_type == "lora", same_experts=experts == "shared", expert_down=expert_down
    )
    shards = build_shards(peft, cfg, lora_type=lora_type, experts=experts, **layout)
    adapter = export(shards, base_config=cfg, alpha=16, rank=rank, lora_type=lora_type, slot=layout.get("slot"))
    assert sorted(adapter.tensors) == sorted(peft)
    for key, expected in peft.items():
        got = adapter.tensors[key]
        assert got.dtype == expected.dtype and torch.equal(got, expected), key
    return adapter


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("pp", [1, 2])
def test_dense_fused_lora_every_tp_pp(tp, pp):
    adapter = _roundtrip(config(heads=8, kv_heads=4, layers=4), tp=tp, pp=pp)
    assert adapter.config.r == 8 and adapter.config.lora_alpha == 16 and not adapter.config.use_rslora
    assert adapter.config.target_modules == ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp"),
    [
        (4, 1, 1),  # MQA, 4 query heads per group
        (4, 1, 2),  # TP > KV heads: a rank holds half a group
        (4, 1, 4),
        (6, 2, 2),  # 3 query heads per group
        (8, 2, 4),  # TP > KV heads with 2 groups
        (4, 4, 2),  # MHA
    ],
)
def test_gqa_deinterleave(heads, kv_heads, tp):
    _roundtrip(config(heads=heads, kv_heads=kv_heads), tp=tp)


def test_module_prefixes_and_base_weights_are_tolerated():
    _roundtrip(config(), tp=2, prefix="module.module.")


def test_padding_to_max_rank_is_trimmed():
    adapter = _roundtrip(config(layers=4), r=5, rank=5, max_rank=8, tp=2, pp=2)
    assert adapter.config.r == 5


def test_multilora_slot_is_selected_and_trimmed():
    _roundtrip(config(), r=3, rank=3, max_rank=4, tp=2, slot=2)


def test_multilora_slot_on_packed_experts_is_selected_and_trimmed():
    # Megatron-Bridge's MultiLoRAGroupedExpertLinear: adapters.{i} of [n_local, r_max, in] / [n_local, out, r_max],
    # zeroed beyond the slot's rank; expert-TP 1 only (it refuses expert TP itself)
    _roundtrip(config(experts=4), r=3, rank=3, max_rank=4, tp=1, ep=2, slot=1, experts="grouped")


@pytest.mark.parametrize("tp", [1, 2])
def test_canonical_lora(tp):
    _roundtrip(config(), lora_type="canonical_lora", tp=tp, pp=2)


def test_moe_sequential_experts_renumbered_by_ep_rank():
    adapter = _roundtrip(config(experts=4), tp=1, ep=2, experts="sequential")
    assert "base_model.model.model.layers.1.mlp.experts.3.down_proj.lora_B.weight" in adapter.tensors


@pytest.mark.parametrize("experts", ["sequential", "grouped", "shared"])
def test_moe_expert_fc1_at_expert_tp2(experts):
    # expert-TP 2 gathers fc1 exactly; expert fc2 there is refused (test_megatron_errors)
    adapter = _roundtrip(config(experts=4), tp=2, ep=2, experts=experts, expert_down=False)
    assert "base_model.model.model.layers.1.mlp.experts.3.up_proj.lora_B.weight" in adapter.tensors


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (1, 2), (2, 2)])
def test_canonical_lora_on_sequential_experts(tp, ep):
    # CanonicalLoRA gives each SequentialMLP expert's fc1 adapter_gate / adapter_up
    adapter = _roundtrip(
        config(experts=4), lora_type="canonical_lora", tp=tp, ep=ep, experts="sequential", expert_down=tp == 1
    )
    assert "base_model.model.model.layers.0.mlp.experts.2.gate_proj.lora_A.weight" in adapter.tensors


def test_moe_sequential_experts_with_pp():
    _roundtrip(config(experts=4, layers=4), tp=1, pp=2, ep=2, experts="sequential")


def test_moe_grouped_shared_adapter_emitted_per_expert():
    adapter = _roundtrip(config(experts=4), tp=2, ep=2, experts="shared", expert_down=False)
    a0 = adapter.tensors["base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight"]
    a3 = adapter.tensors["base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight"]
    assert torch.equal(a0, a3) and a0.data_ptr() != a3.data_ptr()  # copies, so safetensors can save them


@pytest.mark.parametrize(("tp", "ep"), [(1, 2), (2, 2), (2, 1)])
def test_moe_grouped_per_expert_3d(tp, ep):
    _roundtrip(config(experts=4, layers=2), tp=tp, ep=ep, pp=2, experts="grouped", expert_down=tp == 1)


def test_moe_packed_experts_padding_trimmed():
    _roundtrip(config(experts=4), r=6, rank=6, max_rank=8, tp=2, ep=2, experts="grouped", expert_down=False)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_router_adapter_becomes_mlp_gate(tp):
    # Megatron-Bridge shards the router adapter column-wise: A [r/TP, hidden], B [E/TP, r] per rank
    cfg = config(experts=4)
    adapter = _roundtrip(cfg, tp=tp, experts="sequential", expert_down=tp == 1)
    a, b = adapter.pair("model.layers.0.mlp.gate")
    assert a.shape == (8, 32) and b.shape == (4, 8)
    shard = build_shards(make_peft(cfg, r=8, seed=7), cfg, tp=tp)[(0, tp - 1)]
    assert shard["decoder.layers.0.mlp.router.adapter.linear_in.weight"].shape == (8 // tp, 32)
    assert shard["decoder.layers.0.mlp.router.adapter.linear_out.weight"].shape == (4 // tp, 8)


def test_shard_key_forms_are_equivalent():
    cfg = config()
    peft = make_peft(cfg, r=8, seed=1)
    shards = build_shards(peft, cfg, tp=2)
    as_keys = {ShardKey(pp=k[0], tp=k[1]): v for k, v in shards.items()}
    as_triples = {(k[0], k[1], 0): v for k, v in shards.items()}
    first = export(shards, base_config=cfg, alpha=16)
    assert export(as_keys, base_config=cfg, alpha=16).content_hash == first.content_hash
    assert export(as_triples, base_config=cfg, alpha=16).content_hash == first.content_hash


def test_a_plain_chunk_of_fc1_would_be_wrong_here():
    """Guards the fixture: at TP=2 the gathered fc1 B is [g0; u0; g1; u1], so the round trip above
    only passes because the exporter splits per TP rank."""
    cfg = config()
    peft = make_peft(cfg, r=8, seed=3)
    shards = build_shards(peft, cfg, tp=2)
    gathered = torch.cat([shards[(0, t)]["decoder.layers.0.mlp.linear_fc1.adapter.linear_out.weight"] for t in (0, 1)])
    naive_gate = gathered.chunk(2)[0]
    assert not torch.equal(naive_gate, peft["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"])


def test_uneven_pipeline_with_explicit_offsets():
    cfg = config(layers=3)
    peft = make_peft(cfg, r=4, seed=5)
    one_stage = build_shards(peft, cfg, tp=1)[(0, 0)]
    # stage 0 holds layer 0, stage 1 holds layers 1-2 (renumbered 0-1 locally)
    stage0 = {k: v for k, v in one_stage.items() if k.startswith("decoder.layers.0.")}
    stage1 = {
        k.replace(f"decoder.layers.{i}.", f"decoder.layers.{i - 1}."): v
        for i in (1, 2)
        for k, v in one_stage.items()
        if k.startswith(f"decoder.layers.{i}.")
    }
    adapter = export({(0, 0): stage0, (1, 0): stage1}, base_config=cfg, alpha=8, layer_offsets=[0, 1])
    assert all(torch.equal(adapter.tensors[k], v) for k, v in peft.items()) and len(adapter.tensors) == len(peft)


def test_virtual_pipeline_default_offsets():
    # PP=2, VPP=2, 8 layers: (pp, vp) holds global layers vp*4 + pp*2 + {0, 1}
    cfg = config(layers=8)
    peft = make_peft(cfg, r=4, seed=6)
    flat = build_shards(peft, cfg)[(0, 0)]
    shards = {}
    for pp in range(2):
        for vp in range(2):
            first = vp * 4 + pp * 2
            shards[ShardKey(pp=pp, tp=0, vp=vp)] = {
                k.replace(f"decoder.layers.{g}.", f"decoder.layers.{g - first}."): v
                for g in (first, first + 1)
                for k, v in flat.items()
                if k.startswith(f"decoder.layers.{g}.")
            }
    adapter = export(shards, base_config=cfg, alpha=8)
    assert all(torch.equal(adapter.tensors[k], v) for k, v in peft.items()) and len(adapter.tensors) == len(peft)


def test_dtype_is_kept_and_castable():
    cfg = config()
    peft = {k: v.to(torch.bfloat16) for k, v in make_peft(cfg, r=4, seed=2).items()}
    shards = build_shards(peft, cfg, tp=2)
    assert export(shards, base_config=cfg, alpha=8).dtype == torch.bfloat16
    assert export(shards, base_config=cfg, alpha=8, dtype=torch.float32).dtype == torch.float32
