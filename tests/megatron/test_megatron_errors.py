"""Bad input is refused with a typed lorasync error that names the problem."""

from __future__ import annotations

import pytest
import torch
from _shard_builder import build_shards, config, make_peft

from lorasync.errors import (
    ConfigError,
    ExportError,
    GeometryError,
    InexactExportError,
    MissingShardError,
    PaddedRankError,
    UnknownAdapterNameError,
    UnknownModuleError,
)
from lorasync.exporters.megatron import export

QKV_IN = "decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight"
QKV_OUT = "decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight"


def _shards(cfg=None, *, r=8, **layout):
    cfg = cfg or config()
    return cfg, build_shards(make_peft(cfg, r=r, seed=0, shared_a=layout.get("lora_type", "lora") == "lora"), cfg, **layout)


def test_missing_rank_is_named():
    cfg, shards = _shards(tp=2, pp=2)
    del shards[(1, 0)]
    with pytest.raises(MissingShardError, match=r"pp=1, tp=0"):
        export(shards, base_config=cfg, alpha=8)


def test_missing_trailing_rank_is_found_with_explicit_tp_size():
    cfg, shards = _shards(tp=4)
    del shards[(0, 3)]
    with pytest.raises(MissingShardError, match=r"\(pp=0, tp=3"):
        export(shards, base_config=cfg, alpha=8, tp_size=4)
    # without tp_size, TP=3 is inferred and the gathered shapes no longer fit
    with pytest.raises(GeometryError, match="TP=3"):
        export(shards, base_config=cfg, alpha=8)


def test_tensor_missing_on_one_tp_rank():
    cfg, shards = _shards(tp=2)
    del shards[(0, 1)][QKV_IN]
    with pytest.raises(MissingShardError, match="tp=1"):
        export(shards, base_config=cfg, alpha=8)


def test_factor_missing_everywhere():
    cfg, shards = _shards(tp=2)
    for shard in shards.values():
        del shard[QKV_OUT]
    with pytest.raises(MissingShardError, match="linear_in but no linear_out"):
        export(shards, base_config=cfg, alpha=8)


def test_tp_that_does_not_divide_heads():
    # 4 attention heads cannot be split over TP=8 (the tensors themselves happen to divide)
    cfg, shards = _shards(tp=8)
    with pytest.raises(GeometryError, match="TP=8 does not divide num_attention_heads=4"):
        export(shards, base_config=cfg, alpha=8)


def test_shards_for_another_model():
    cfg, shards = _shards(tp=2)
    with pytest.raises(GeometryError, match="do not fit the base model"):
        export(shards, base_config=config(heads=8, kv_heads=2, head_dim=4), alpha=8)


def test_head_counts_that_do_not_divide():
    cfg, shards = _shards()
    with pytest.raises(GeometryError, match="not a multiple of num_key_value_heads"):
        export(shards, base_config=config(heads=6, kv_heads=4), alpha=8)


def test_rank_not_divisible_by_tp():
    cfg, shards = _shards(r=6, tp=1)
    full = shards[(0, 0)]
    four = {(0, t): {} for t in range(4)}
    for t in range(4):
        for name, tensor in full.items():
            four[(0, t)][name] = tensor  # content is irrelevant: the shapes already disagree
        four[(0, t)][QKV_IN] = torch.zeros(2, 32)  # 4 x 2 = 8 rows of A for r = 6
        four[(0, t)][QKV_OUT] = torch.zeros(64 // 4, 6)
    with pytest.raises(GeometryError, match="r=6 is not divisible by TP=4"):
        export(four, base_config=cfg, alpha=8)


def test_column_parallel_a_that_is_not_rank_sharded():
    cfg, shards = _shards(tp=2)
    full_a = torch.cat([shards[(0, t)][QKV_IN] for t in (0, 1)])
    for t in (0, 1):
        shards[(0, t)][QKV_IN] = full_a  # replicated instead of [r/TP, in]
    with pytest.raises(GeometryError, match="sharded on its rank axis"):
        export(shards, base_config=cfg, alpha=8)


def test_uneven_shards():
    cfg, shards = _shards(tp=2)
    shards[(0, 1)][QKV_IN] = shards[(0, 1)][QKV_IN][:3]
    with pytest.raises(GeometryError, match="differs in shape"):
        export(shards, base_config=cfg, alpha=8)


@pytest.mark.parametrize(("name", "index"), [(QKV_IN, (3, 0)), (QKV_OUT, (0, 7))])
def test_trained_padding(name, index):
    cfg, shards = _shards(r=5, tp=2, max_rank=8)
    export(shards, base_config=cfg, alpha=8, rank=5)  # clean padding exports
    shards[(0, 1)][name] = shards[(0, 1)][name].clone()
    shards[(0, 1)][name][index] = 0.5  # global A row 7 / B column 7: beyond rank 5
    with pytest.raises(PaddedRankError, match="not zero"):
        export(shards, base_config=cfg, alpha=8, rank=5)


def test_rank_above_the_trained_width():
    cfg, shards = _shards(r=4)
    with pytest.raises(GeometryError, match="exceeds"):
        export(shards, base_config=cfg, alpha=8, rank=8)


@pytest.mark.parametrize(
    "name",
    [
        "decoder.layers.0.self_attention.linear_q_down_proj.adapter.linear_in.weight",
        "output_layer.adapter.linear_in.weight",
        "decoder.layers.0.self_attention.linear_qkv.adapter.adapter_gate.linear_in.weight",
    ],
)
def test_unknown_module(name):
    cfg, shards = _shards(lora_type="canonical_lora")
    shards[(0, 0)][name] = torch.zeros(8, 32)
    with pytest.raises(UnknownModuleError):
        export(shards, base_config=cfg, alpha=8, lora_type="canonical_lora")


def test_lora_type_mismatch():
    cfg, canonical = _shards(lora_type="canonical_lora")
    with pytest.raises(ConfigError, match="lora_type='canonical_lora'"):
        export(canonical, base_config=cfg, alpha=8)
    cfg, fused = _shards()
    with pytest.raises(ConfigError, match="lora_type='lora'"):
        export(fused, base_config=cfg, alpha=8, lora_type="canonical_lora")


def test_slots_need_a_choice():
    cfg, shards = _shards(slot=0)
    with pytest.raises(ConfigError, match="pass slot="):
        export(shards, base_config=cfg, alpha=8)
    with pytest.raises(UnknownAdapterNameError, match="slot 5 not found"):
        export(shards, base_config=cfg, alpha=8, slot=5)


def test_no_adapter_at_all():
    with pytest.raises(UnknownAdapterNameError):
        export({(0, 0): {"decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(2, 2)}}, base_config=config(), alpha=8)


def test_layers_beyond_the_base_model():
    cfg, shards = _shards(config(layers=4), pp=2)
    with pytest.raises(GeometryError, match="global layer"):
        export(shards, base_config=config(layers=2), alpha=8)


def test_expert_adapter_on_a_dense_model():
    cfg, shards = _shards(config(experts=4), ep=2)
    with pytest.raises(GeometryError, match="no MoE experts"):
        export(shards, base_config=config(), alpha=8)


@pytest.mark.parametrize("key", [(0,), (0, 0, 0, 0, 0), ("0", 0), (-1, 0)])
def test_bad_shard_keys(key):
    with pytest.raises(ConfigError):
        export({key: {}}, base_config=config(), alpha=8)


def test_same_rank_twice():
    cfg, shards = _shards()
    with pytest.raises(ConfigError, match="given twice"):
        export({(0, 0): shards[(0, 0)], (0, 0, 0): shards[(0, 0)]}, base_config=cfg, alpha=8)


def test_unreadable_base_config(tmp_path):
    from lorasync.errors import StorageError

    cfg, shards = _shards()
    with pytest.raises(StorageError):
        export(shards, base_config=tmp_path / "nope", alpha=8)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError):
        export(shards, base_config=tmp_path, alpha=8)


def test_errors_share_the_export_root():
    for cls in (MissingShardError, GeometryError, UnknownModuleError, UnknownAdapterNameError):
        assert issubclass(cls, ExportError) and issubclass(cls, ValueError)


def test_moe_models_with_other_expert_names_are_refused():
    cfg, shards = _shards(config(experts=4), ep=2)
    mixtral = dict(cfg, model_type="mixtral", num_local_experts=4)
    del mixtral["num_experts"]
    with pytest.raises(UnknownModuleError, match="mixtral"):
        export(shards, base_config=mixtral, alpha=8)


@pytest.mark.parametrize("experts", ["sequential", "grouped", "shared"])
def test_expert_fc2_at_expert_tp2_is_refused(experts):
    # Megatron's expert row-parallel path computes TP*s*blockdiag(B_t A_t) there: not a LoRA
    cfg = config(experts=4)
    peft = make_peft(cfg, r=8, seed=0, same_experts=experts == "shared")
    shards = build_shards(peft, cfg, tp=2, ep=2, experts=experts)
    with pytest.raises(InexactExportError, match=r"expert linear_fc2 .* expert-TP=2 .*expert_tensor_parallel_size=1"):
        export(shards, base_config=cfg, alpha=8)


@pytest.mark.parametrize(("tp", "slot"), [(1, None), (2, None), (2, 1)])
def test_dora_magnitudes_are_refused_never_dropped(tp, slot):
    cfg = config()
    shards = build_shards(make_peft(cfg, r=8, seed=0), cfg, tp=tp, slot=slot, dora=True)
    assert any(name.endswith(".weight_magnitude") for name in shards[(0, 0)])
    with pytest.raises(InexactExportError, match=r"weight_magnitude.*DoRA.*train with LoRA"):
        export(shards, base_config=cfg, alpha=8, slot=slot)
    # only the magnitudes make it DoRA: the same shards without them export
    plain = {k: {n: t for n, t in sd.items() if not n.endswith("weight_magnitude")} for k, sd in shards.items()}
    assert export(plain, base_config=cfg, alpha=8, slot=slot).config.r == 8
