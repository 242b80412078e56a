"""Numerical check independent of the exporter's splitting code: compute what Megatron computes
with the fused tensors of each TP rank, de-interleave it with trainer-formats.md §1.3, and compare
with PEFT's per-projection ΔW (and with the exported adapter's ΔW)."""

from __future__ import annotations

import pytest
import torch
from _shard_builder import Geo, build_shards, config, make_peft, qkv_rows

from lorasync.exporters.megatron import export

ALPHA = 16.0
R = 8
P = "base_model.model.model.layers.{}."


def _peft_delta(peft, module):
    a = peft[f"base_model.model.{module}.lora_A.weight"].double()
    b = peft[f"base_model.model.{module}.lora_B.weight"].double()
    return (b @ a) * (ALPHA / R)


def _rank_tensors(shards, tp, name):
    return [shards[(0, t)][name].double() for t in range(tp)]


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 2, 2), (4, 1, 2), (6, 2, 1), (8, 2, 4)])
def test_fused_qkv_delta_deinterleaves_to_peft(heads, kv_heads, tp):
    cfg = config(heads=heads, kv_heads=kv_heads)
    g = Geo.of(cfg)
    peft = make_peft(cfg, r=R, seed=11)
    shards = build_shards(peft, cfg, tp=tp)
    adapter = export(shards, base_config=cfg, alpha=ALPHA)
    layer = "decoder.layers.1.self_attention.linear_qkv.adapter."
    # linear_in is ColumnParallel with gather_output=True: every rank sees the full [r, in] A.
    a_full = torch.cat(_rank_tensors(shards, tp, layer + "linear_in.weight"), 0)
    # linear_out is ColumnParallel with gather_output=False: rank t computes its own output rows.
    fused = torch.cat([b_t @ a_full for b_t in _rank_tensors(shards, tp, layer + "linear_out.weight")], 0)
    fused = fused * (ALPHA / R)  # Megatron scale alpha / dim

    # §1.3 per-row formulas
    q_rows, k_rows, v_rows = qkv_rows(g)
    for proj, rows in (("q_proj", q_rows), ("k_proj", k_rows), ("v_proj", v_rows)):
        module = P.format(1) + f"self_attn.{proj}"
        torch.testing.assert_close(fused[rows], _peft_delta(peft, module[len("base_model.model."):]), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(adapter.delta(module[len("base_model.model."):], torch.float64), fused[rows], rtol=1e-12, atol=1e-12)

    # Megatron's runtime split of a fused output (attention.py): [ng, (np/ng + 2) * hn] → q, k, v
    x = torch.randn(3, g.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mixed = (x @ fused.T).view(3, g.kv, (g.hpg + 2) * g.d)
    q, k, v = torch.split(mixed, [g.hpg * g.d, g.d, g.d], dim=-1)
    for proj, out in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
        expected = x @ _peft_delta(peft, f"model.layers.1.self_attn.{proj}").T
        torch.testing.assert_close(out.reshape(3, -1), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fused_fc1_delta_splits_per_rank_into_gate_and_up(tp):
    cfg = config()
    peft = make_peft(cfg, r=R, seed=12)
    shards = build_shards(peft, cfg, tp=tp)
    layer = "decoder.layers.0.mlp.linear_fc1.adapter."
    a_full = torch.cat(_rank_tensors(shards, tp, layer + "linear_in.weight"), 0)
    gate, up = [], []
    for b_t in _rank_tensors(shards, tp, layer + "linear_out.weight"):
        local = (b_t @ a_full) * (ALPHA / R)  # this rank's fc1 output rows
        g_t, u_t = torch.chunk(local, 2, 0)  # glu(): first half is the gate (mlp.py)
        gate.append(g_t)
        up.append(u_t)
    torch.testing.assert_close(torch.cat(gate), _peft_delta(peft, "model.layers.0.mlp.gate_proj"), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat(up), _peft_delta(peft, "model.layers.0.mlp.up_proj"), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_proj_forward_matches_peft(tp):
    cfg = config()
    peft = make_peft(cfg, r=R, seed=13)
    shards = build_shards(peft, cfg, tp=tp)
    layer = "decoder.layers.0.self_attention.linear_proj.adapter."
    x = torch.randn(5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    a_parts = _rank_tensors(shards, tp, layer + "linear_in.weight")
    b_full = torch.cat(_rank_tensors(shards, tp, layer + "linear_out.weight"), 0)
    # RowParallel linear_in: each rank sees its input slice, partial sums are all-reduced
    width = 32 // tp
    z = sum(x[:, t * width : (t + 1) * width] @ a_parts[t].T for t in range(tp))
    y = (z @ b_full.T) * (ALPHA / R)
    torch.testing.assert_close(y, x @ _peft_delta(peft, "model.layers.0.self_attn.o_proj").T, rtol=1e-12, atol=1e-12)
