"""Independent inverse of the Megatron exporter: a PEFT adapter → Megatron-Bridge rank shards.

Written from trainer-formats.md §1-3 and §6 only (names, shard rules, per-row index formulas),
never from lorasync's exporter, so a round trip through both checks the exporter against the
spec rather than against itself. Row positions of the fused QKV tensor use the per-row formulas
of §1.3 (``G = hpg + 2``):

    q head j, feature t: (j // hpg)·G·d + (j % hpg)·d + t
    k head g:            g·G·d + hpg·d + t
    v head g:            g·G·d + (hpg+1)·d + t
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

PREFIX = "base_model.model."


def config(
    *,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    intermediate: int = 48,
    layers: int = 2,
    experts: int = 0,
    moe_intermediate: int = 16,
) -> dict[str, Any]:
    """An HF ``config.json`` dict with the given geometry (Qwen-MoE field names for experts)."""
    cfg: dict[str, Any] = {
        "model_type": "qwen3_moe" if experts else "llama",
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
    }
    if experts:
        cfg["num_experts"] = experts
        cfg["moe_intermediate_size"] = moe_intermediate
    return cfg


@dataclass(frozen=True)
class Geo:
    hidden: int
    heads: int
    kv: int
    d: int
    inter: int
    layers: int
    experts: int
    moe_inter: int

    @classmethod
    def of(cls, cfg: dict[str, Any]) -> Geo:
        return cls(
            cfg["hidden_size"],
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
            cfg["head_dim"],
            cfg["intermediate_size"],
            cfg["num_hidden_layers"],
            cfg.get("num_experts", 0),
            cfg.get("moe_intermediate_size", 0),
        )

    @property
    def hpg(self) -> int:
        return self.heads // self.kv


def make_peft(
    cfg: dict[str, Any],
    *,
    r: int,
    seed: int,
    shared_a: bool = True,
    router: bool = True,
    same_experts: bool = False,
    expert_down: bool = True,
) -> dict[str, torch.Tensor]:
    """A random PEFT adapter for ``cfg``. ``shared_a`` gives q/k/v and gate/up one lora_A (what
    fused Megatron LoRA can express); ``same_experts`` makes every expert identical (what a
    shared grouped-GEMM adapter can express); ``expert_down=False`` leaves the experts' down_proj
    out (what can be exported at expert-TP > 1)."""
    g = Geo.of(cfg)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    out: dict[str, torch.Tensor] = {}

    def put(module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        out[f"{PREFIX}{module}.lora_A.weight"] = a
        out[f"{PREFIX}{module}.lora_B.weight"] = b

    for layer in range(g.layers):
        p = f"model.layers.{layer}."
        a_qkv = rnd(r, g.hidden)
        put(p + "self_attn.q_proj", a_qkv if shared_a else rnd(r, g.hidden), rnd(g.heads * g.d, r))
        put(p + "self_attn.k_proj", a_qkv.clone() if shared_a else rnd(r, g.hidden), rnd(g.kv * g.d, r))
        put(p + "self_attn.v_proj", a_qkv.clone() if shared_a else rnd(r, g.hidden), rnd(g.kv * g.d, r))
        put(p + "self_attn.o_proj", rnd(r, g.heads * g.d), rnd(g.hidden, r))
        if g.experts:
            first: tuple[torch.Tensor, ...] | None = None
            for e in range(g.experts):
                if same_experts and first is not None:
                    tensors = tuple(t.clone() for t in first)
                else:
                    a_gu = rnd(r, g.hidden)
                    tensors = (a_gu, rnd(g.moe_inter, r), a_gu.clone() if shared_a else rnd(r, g.hidden),
                               rnd(g.moe_inter, r), rnd(r, g.moe_inter), rnd(g.hidden, r))
                    first = first or tensors
                put(p + f"mlp.experts.{e}.gate_proj", tensors[0], tensors[1])
                put(p + f"mlp.experts.{e}.up_proj", tensors[2], tensors[3])
                if expert_down:
                    put(p + f"mlp.experts.{e}.down_proj", tensors[4], tensors[5])
            if router:
                put(p + "mlp.gate", rnd(r, g.hidden), rnd(g.experts, r))
        else:
            a_gu = rnd(r, g.hidden)
            put(p + "mlp.gate_proj", a_gu, rnd(g.inter, r))
            put(p + "mlp.up_proj", a_gu.clone() if shared_a else rnd(r, g.hidden), rnd(g.inter, r))
            put(p + "mlp.down_proj", rnd(r, g.inter), rnd(g.hidden, r))
    return out


def qkv_rows(g: Geo) -> tuple[list[int], list[int], list[int]]:
    """Fused-QKV row index of every q, k and v output row (HF order), per §1.3."""
    G = g.hpg + 2
    q = [(j // g.hpg) * G * g.d + (j % g.hpg) * g.d + t for j in range(g.heads) for t in range(g.d)]
    k = [h * G * g.d + g.hpg * g.d + t for h in range(g.kv) for t in range(g.d)]
    v = [h * G * g.d + (g.hpg + 1) * g.d + t for h in range(g.kv) for t in range(g.d)]
    return q, k, v


def interleave_qkv(bq: torch.Tensor, bk: torch.Tensor, bv: torch.Tensor, g: Geo) -> torch.Tensor:
    q, k, v = qkv_rows(g)
    fused = torch.full((len(q) + len(k) + len(v), bq.shape[1]), float("nan"), dtype=bq.dtype)
    fused[q], fused[k], fused[v] = bq, bk, bv
    assert not fused.isnan().any()
    return fused


def _piece(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    n = t.shape[dim]
    assert n % size == 0, (tuple(t.shape), dim, size)
    return t.narrow(dim, rank * (n // size), n // size).clone()


def _pad(peft: dict[str, torch.Tensor], max_rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for key, t in peft.items():
        if key.endswith("lora_A.weight"):
            out[key] = torch.cat([t, torch.zeros(max_rank - t.shape[0], t.shape[1], dtype=t.dtype)], 0)
        else:
            out[key] = torch.cat([t, torch.zeros(t.shape[0], max_rank - t.shape[1], dtype=t.dtype)], 1)
    return out


def build_shards(
    peft: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    lora_type: str = "lora",
    experts: str = "sequential",
    max_rank: int | None = None,
    slot: int | None = None,
    prefix: str = "",
    noise: bool = True,
    dora: bool = False,
) -> dict[tuple[int, ...], dict[str, torch.Tensor]]:
    """Megatron-Bridge shards of ``peft``: keys ``(pp, tp)`` or, with ``ep > 1``, ``(pp, tp, ep)``.

    ``experts``: ``"sequential"`` (``local_experts.{e}``), ``"grouped"`` (packed 3-D per-expert
    adapters) or ``"shared"`` (one 2-D grouped-GEMM adapter, every expert identical).
    ``max_rank`` zero-pads every adapter to a MultiLoRA slot's rank; ``slot`` names the adapters
    ``adapters.{slot}`` and adds a decoy slot ``slot + 1`` of random values. With
    ``lora_type="canonical_lora"`` sequential experts get ``adapter_gate``/``adapter_up`` like a
    dense fc1, grouped ones stay fused (what Megatron-Bridge's CanonicalLoRA builds). The router's
    adapter is column-parallel (A ``[r/TP, hidden]``, B ``[E/TP, r]`` per rank). ``dora`` adds a
    random ``weight_magnitude`` next to every adapter (Megatron-Bridge DoRA).
    """
    g = Geo.of(cfg)
    if max_rank is not None:
        peft = _pad(peft, max_rank)
    per_stage = g.layers // pp
    n_local = g.experts // ep if g.experts else 0
    shards: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}

    def A(module: str) -> torch.Tensor:
        return peft[f"{PREFIX}{module}.lora_A.weight"]

    def B(module: str) -> torch.Tensor:
        return peft[f"{PREFIX}{module}.lora_B.weight"]

    for s in range(pp):
        for t in range(tp):
            for e in range(ep):
                sd: dict[str, torch.Tensor] = {}
                container = "adapter" if slot is None else f"adapters.{slot}"

                def emit(local: int, path: str, a: torch.Tensor, b: torch.Tensor, sub: str = "") -> None:
                    base = f"{prefix}decoder.layers.{local}.{path}.{container}{sub}"
                    sd[f"{base}.linear_in.weight"] = a
                    sd[f"{base}.linear_out.weight"] = b
                    if dora:
                        sd[f"{base}.weight_magnitude"] = torch.rand(b.shape[-2]) + 0.5
                    if slot is not None:  # a decoy slot the exporter must not pick up
                        decoy = f"{prefix}decoder.layers.{local}.{path}.adapters.{slot + 1}{sub}"
                        sd[f"{decoy}.linear_in.weight"] = torch.randn_like(a)
                        sd[f"{decoy}.linear_out.weight"] = torch.randn_like(b)

                def column(m: str) -> tuple[torch.Tensor, torch.Tensor]:
                    return _piece(A(m), 0, t, tp), _piece(B(m), 0, t, tp)

                def row(m: str) -> tuple[torch.Tensor, torch.Tensor]:
                    return _piece(A(m), 1, t, tp), _piece(B(m), 0, t, tp)

                def fc1(gate: str, up: str) -> tuple[torch.Tensor, torch.Tensor]:
                    # this rank's linear_out rows are [gate_t; up_t] (fc1_stride=2, §1.3)
                    assert torch.equal(A(gate), A(up)), "fused fc1 needs gate/up to share lora_A"
                    b = torch.cat([_piece(B(gate), 0, t, tp), _piece(B(up), 0, t, tp)], 0)
                    return _piece(A(gate), 0, t, tp), b

                for local in range(per_stage):
                    p = f"model.layers.{s * per_stage + local}."
                    if lora_type == "lora":
                        q, k, v = (p + f"self_attn.{x}_proj" for x in "qkv")
                        assert torch.equal(A(q), A(k)) and torch.equal(A(q), A(v)), "fused qkv needs one lora_A"
                        fused_b = interleave_qkv(B(q), B(k), B(v), g)
                        emit(local, "self_attention.linear_qkv", _piece(A(q), 0, t, tp), _piece(fused_b, 0, t, tp))
                    else:
                        for x in "qkv":
                            emit(local, "self_attention.linear_qkv", *column(p + f"self_attn.{x}_proj"), sub=f".adapter_{x}")
                    emit(local, "self_attention.linear_proj", *row(p + "self_attn.o_proj"))
                    if not g.experts:
                        if lora_type == "lora":
                            emit(local, "mlp.linear_fc1", *fc1(p + "mlp.gate_proj", p + "mlp.up_proj"))
                        else:
                            emit(local, "mlp.linear_fc1", *column(p + "mlp.gate_proj"), sub=".adapter_gate")
                            emit(local, "mlp.linear_fc1", *column(p + "mlp.up_proj"), sub=".adapter_up")
                        emit(local, "mlp.linear_fc2", *row(p + "mlp.down_proj"))
                        continue
                    mine = [e * n_local + i for i in range(n_local)]
                    ex = [
                        tuple(p + f"mlp.experts.{E}.{proj}" for proj in ("gate_proj", "up_proj", "down_proj"))
                        for E in range(g.experts)
                    ]
                    has_down = f"{PREFIX}{ex[0][2]}.lora_A.weight" in peft
                    if experts == "sequential":
                        for i, E in enumerate(mine):
                            fc1_path = f"mlp.experts.local_experts.{i}.linear_fc1"
                            if lora_type == "lora":
                                emit(local, fc1_path, *fc1(ex[E][0], ex[E][1]))
                            else:
                                emit(local, fc1_path, *column(ex[E][0]), sub=".adapter_gate")
                                emit(local, fc1_path, *column(ex[E][1]), sub=".adapter_up")
                            if has_down:
                                emit(local, f"mlp.experts.local_experts.{i}.linear_fc2", *row(ex[E][2]))
                    elif experts == "grouped":
                        fc1s = [fc1(ex[E][0], ex[E][1]) for E in mine]
                        emit(local, "mlp.experts.linear_fc1", torch.stack([a for a, _ in fc1s]), torch.stack([b for _, b in fc1s]))
                        if has_down:
                            fc2s = [row(ex[E][2]) for E in mine]
                            emit(local, "mlp.experts.linear_fc2", torch.stack([a for a, _ in fc2s]), torch.stack([b for _, b in fc2s]))
                    else:
                        for E in range(g.experts):
                            for m in range(3 if has_down else 2):
                                assert torch.equal(A(ex[E][m]), A(ex[0][m])) and torch.equal(B(ex[E][m]), B(ex[0][m]))
                        emit(local, "mlp.experts.linear_fc1", *fc1(ex[0][0], ex[0][1]))
                        if has_down:
                            emit(local, "mlp.experts.linear_fc2", *row(ex[0][2]))
                    if f"{PREFIX}{p}mlp.gate.lora_A.weight" in peft:
                        emit(local, "mlp.router", *column(p + "mlp.gate"))
                if noise:  # base weights and TE extra state live in the same state dict
                    sd[f"{prefix}decoder.layers.0.self_attention.linear_qkv.to_wrap.weight"] = torch.zeros(2, 2)
                    sd[f"{prefix}decoder.layers.0.self_attention.linear_qkv.adapter.linear_in._extra_state"] = torch.zeros(0)
                    sd[f"{prefix}embedding.word_embeddings.weight"] = torch.zeros(3, 2)
                shards[(s, t, e) if ep > 1 else (s, t)] = sd
    return shards
