"""The name rules and their derived inverse round-trip; pipeline offsets follow Megatron."""

from __future__ import annotations

import pytest

from lorasync.errors import GeometryError, UnknownModuleError
from lorasync.exporters.megatron._layout import stage_offsets
from lorasync.exporters.megatron._names import hf_modules, parse_name
from lorasync.exporters.megatron import RULES, megatron_name

# (Megatron name with global layer, lora_type, experts layout, ep_rank) -> expected HF modules
CASES = [
    ("decoder.layers.3.self_attention.linear_qkv.adapter.linear_in.weight", "lora", "grouped", 0,
     ["model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.k_proj", "model.layers.3.self_attn.v_proj"]),
    ("decoder.layers.3.self_attention.linear_qkv.adapter.adapter_k.linear_out.weight", "canonical_lora", "grouped", 0,
     ["model.layers.3.self_attn.k_proj"]),
    ("decoder.layers.0.self_attention.linear_proj.adapter.linear_in.weight", "lora", "grouped", 0,
     ["model.layers.0.self_attn.o_proj"]),
    ("decoder.layers.1.mlp.linear_fc1.adapter.linear_out.weight", "lora", "grouped", 0,
     ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]),
    ("decoder.layers.1.mlp.linear_fc1.adapter.adapter_up.linear_in.weight", "canonical_lora", "grouped", 0,
     ["model.layers.1.mlp.up_proj"]),
    ("decoder.layers.1.mlp.linear_fc2.adapter.linear_out.weight", "lora", "grouped", 0,
     ["model.layers.1.mlp.down_proj"]),
    ("decoder.layers.2.mlp.experts.linear_fc1.adapter.linear_in.weight", "lora", "grouped", 0,
     ["model.layers.2.mlp.experts.5.gate_proj", "model.layers.2.mlp.experts.5.up_proj"]),
    ("decoder.layers.2.mlp.experts.linear_fc2.adapter.linear_out.weight", "lora", "grouped", 0,
     ["model.layers.2.mlp.experts.5.down_proj"]),
    ("decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.adapter.linear_out.weight", "lora", "sequential", 2,
     ["model.layers.2.mlp.experts.5.gate_proj", "model.layers.2.mlp.experts.5.up_proj"]),
    ("decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.adapter.linear_in.weight", "lora", "sequential", 2,
     ["model.layers.2.mlp.experts.5.down_proj"]),
    ("decoder.layers.4.mlp.router.adapter.linear_in.weight", "lora", "grouped", 0, ["model.layers.4.mlp.gate"]),
]


@pytest.mark.parametrize(("name", "lora_type", "experts", "ep_rank", "hf"), CASES)
def test_rules_round_trip(name, lora_type, experts, ep_rank, hf):
    parsed = parse_name(name)
    assert parsed is not None
    n_local = 2
    expert = ep_rank * n_local + parsed.local_expert if parsed.local_expert is not None else 5
    produced = hf_modules(parsed.rule, parsed.layer, expert=expert)
    if parsed.sub:
        produced = (produced[parsed.rule.subs.index(parsed.sub)],)
    assert list(produced) == hf
    for module in hf:
        ref = megatron_name(module, parsed.side, lora_type=lora_type, experts=experts, num_local_experts=n_local)
        assert ref.name == name
        assert ref.ep_rank == ep_rank
        assert hf_modules(parsed.rule, parsed.layer, expert=expert)[ref.piece] == module


def test_every_rule_is_covered_by_the_cases():
    covered = {parse_name(case[0]).rule for case in CASES}
    assert covered == set(RULES)


def test_slot_names_round_trip():
    ref = megatron_name("model.layers.0.self_attn.v_proj", "B", slot=3)
    assert ref.name == "decoder.layers.0.self_attention.linear_qkv.adapters.3.linear_out.weight" and ref.piece == 2
    parsed = parse_name("module." + ref.name)
    assert parsed.slot == 3 and parsed.side == "B" and parsed.layer == 0


@pytest.mark.parametrize(
    "name",
    [
        "decoder.layers.0.self_attention.linear_qkv.to_wrap.weight",
        "decoder.layers.0.self_attention.linear_qkv.adapter.linear_in._extra_state",
        "embedding.word_embeddings.weight",
        "module.decoder.final_layernorm.weight",
    ],
)
def test_non_adapter_names_are_skipped(name):
    assert parse_name(name) is None


def test_inverse_rejects_unknown_hf_modules():
    with pytest.raises(UnknownModuleError):
        megatron_name("model.layers.0.self_attn.q_a_proj", "A")


def test_stage_offsets_follow_megatron():
    # trainer-formats.md §1.4: PP=2, 32 layers: pp 1 local 3 -> 19; VPP=2: pp 1, vp 1, local 3 -> 27
    assert stage_offsets(32, 2, 1, None)[(1, 0)] + 3 == 19
    assert stage_offsets(32, 2, 2, None)[(1, 1)] + 3 == 27
    assert stage_offsets(5, 2, 1, [0, 3]) == {(0, 0): 0, (1, 0): 3}
    assert stage_offsets(8, 2, 2, {(0, 0): 0, (1, 0): 2, (0, 1): 4, (1, 1): 7})[(1, 1)] == 7
    with pytest.raises(GeometryError, match="layer_offsets"):
        stage_offsets(5, 2, 1, None)
    with pytest.raises(GeometryError, match="no offset"):
        stage_offsets(8, 2, 1, {0: 0})
