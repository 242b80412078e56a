"""The export plan: which shard tensors make up each gathered adapter factor, and how.

The plan is computed from metadata only (names, shapes, dtypes per shard), so the offline
exporter and every rank of the online exporter derive the same plan and refuse bad input with
the same error before any tensor moves. Every check that can be made without tensor values
lives here: completeness of the TP/PP/EP grid, pairing of A and B, layer numbering, and shapes
against the base model's geometry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lorasync.errors import (
    ConfigError,
    GeometryError,
    InexactExportError,
    MissingShardError,
    UnknownAdapterNameError,
    UnknownModuleError,
)
from lorasync.exporters.megatron._inputs import LORA_TYPES, Grid, ShardKey
from lorasync.exporters.megatron._layout import Geometry, factor_dims, stage_bounds
from lorasync.exporters.megatron._names import MOE_MODEL_TYPES, RULES, ModuleRule, Side, hf_modules, parse_name

__all__ = ["LORA_TYPES", "FactorPlan", "Grid", "ModulePlan", "ShardKey", "build_plan"]

EpMode = Literal["replicated", "own", "cat"]
ShardMeta = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class FactorPlan:
    """One adapter factor (A or B) of one module: where its pieces are and how they join."""

    side: Side
    stage: tuple[int, int]  # (pp, vp) that owns the layer
    names: Mapping[tuple[int, int], str]  # (tp, ep) -> parameter name in that shard
    tp_size: int
    tp_dim: int | None  # concatenation dim over TP; None = replicated over TP
    ep_mode: EpMode  # replicated over EP, owned by one EP rank, or concatenated on dim 0
    eps: tuple[int, ...]  # EP ranks with a complete copy (replicated), the owner, or all (cat)
    local_shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ModulePlan:
    """One Megatron adapter (A and B) at a global layer, and the HF modules it becomes."""

    layer: int
    rule: ModuleRule
    expert: int | None  # global expert of a sequential expert
    sub: str | None  # CanonicalLoRA sub-adapter
    a: FactorPlan
    b: FactorPlan
    hf: tuple[str, ...]

    @property
    def label(self) -> str:
        """The Megatron adapter this plan reads, for messages."""
        return _label(self.layer, self.rule, self.expert, self.sub)


def _shard_label(key: tuple[int, int, int, int]) -> str:
    return f"(pp={key[0]}, tp={key[1]}, ep={key[2]}, vp={key[3]})"


def build_plan(
    meta: Mapping[ShardKey, ShardMeta],
    grid: Grid,
    geometry: Geometry,
    *,
    lora_type: str = "lora",
    slot: int | None = None,
    layer_offsets: Sequence[int] | Mapping[Any, int] | None = None,
) -> list[ModulePlan]:
    """Plan the export of every adapter found in ``meta``, in (layer, module) order.

    Args:
        meta: per shard, parameter name → (shape, dtype). Non-adapter names are ignored.
        grid: the parallel sizes (complete; see :meth:`Grid.of_keys`).
        geometry: the base model's sizes.
        lora_type: ``"lora"`` (fused qkv/fc1) or ``"canonical_lora"`` (q/k/v, gate/up split).
        slot: the MultiLoRA slot to export (``adapters.{slot}`` names); None for ``adapter``.
        layer_offsets: see :func:`~lorasync.exporters.megatron._layout.stage_offsets`.

    Raises:
        ConfigError, UnknownAdapterNameError, UnknownModuleError, MissingShardError, GeometryError.
        InexactExportError: DoRA magnitudes, or expert linear_fc2 adapters at expert-TP > 1.
    """
    if lora_type not in LORA_TYPES:
        raise ConfigError(f"lora_type must be one of {LORA_TYPES}, got {lora_type!r}")
    bounds = stage_bounds(geometry.layers, grid.pp, grid.vp, layer_offsets)
    entries = _collect(meta, grid, geometry, bounds, lora_type=lora_type, slot=slot)
    factors = {k: _factor(k, e, grid) for k, e in entries.items()}
    order = {rule.megatron: i for i, rule in enumerate(RULES)}
    keys = sorted(
        {k[:4] for k in factors}, key=lambda k: (k[0], order[k[1]], -1 if k[2] is None else k[2], k[3] or "")
    )
    modules: list[ModulePlan] = []
    for layer, megatron, expert, sub in keys:
        a, b = factors.get((layer, megatron, expert, sub, "A")), factors.get((layer, megatron, expert, sub, "B"))
        rule = entries[(layer, megatron, expert, sub, "A" if a else "B")]["rule"]
        if a is None or b is None:
            have, lacks = ("linear_in", "linear_out") if b is None else ("linear_out", "linear_in")
            raise MissingShardError(
                f"{_label(layer, rule, expert, sub)} has {have} but no {lacks}; every adapter needs both factors"
            )
        hf = hf_modules(rule, layer, expert=expert)
        if sub is not None:
            hf = (hf[rule.subs.index(sub)],)
        plan = ModulePlan(layer, rule, expert, sub, a, b, hf)
        _check_module(plan, grid, geometry)
        modules.append(plan)
    return modules


def _collect(
    meta: Mapping[ShardKey, ShardMeta],
    grid: Grid,
    geometry: Geometry,
    bounds: Mapping[tuple[int, int], range],
    *,
    lora_type: str,
    slot: int | None,
) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Group shard tensors by (global layer, module, expert, sub-adapter, side)."""
    entries: dict[tuple[Any, ...], dict[str, Any]] = {}
    slots_seen: set[int | None] = set()
    for key, shard in meta.items():
        for name, (shape, dtype) in shard.items():
            parsed = parse_name(name)
            if parsed is None:
                continue
            slots_seen.add(parsed.slot)
            if parsed.slot != slot:
                continue
            _check_name(name, parsed.rule, parsed.sub, geometry, lora_type)
            stage = bounds[(key.pp, key.vp)]
            if parsed.layer >= len(stage):  # the stages' layer ranges are disjoint: no overlap either
                raise GeometryError(
                    f"{name!r} in shard {_shard_label((key.pp, key.tp, key.ep, key.vp))} is local layer "
                    f"{parsed.layer} of a stage that holds global layers {_span(stage)} of the base model's "
                    f"{geometry.layers}, so it maps to global layer {stage.start + parsed.layer}, outside; "
                    "check layer_offsets (each stage's first global layer, in pipeline order) and the PP size"
                )
            layer = stage[parsed.layer]
            expert = None
            if parsed.rule.experts == "sequential":
                expert = _global_expert(parsed.local_expert, key.ep, grid, geometry, name)
            entry = entries.setdefault(
                (layer, parsed.rule.megatron, expert, parsed.sub, parsed.side),
                {"rule": parsed.rule, "stage": (key.pp, key.vp), "names": {}, "meta": {}},
            )
            coord = (key.tp, key.ep)
            if coord in entry["names"]:
                raise ConfigError(f"shard {key} holds {name!r} twice (as {entry['names'][coord]!r}); remove one")
            entry["names"][coord] = name
            entry["meta"][coord] = (tuple(shape), dtype)

    if slot is None and slots_seen - {None}:
        raise ConfigError(
            f"the shards hold MultiLoRA slots {sorted(s for s in slots_seen if s is not None)}; pass slot= to pick one"
        )
    if not entries:
        if slot is not None:
            found = sorted(s for s in slots_seen if s is not None)
            raise UnknownAdapterNameError(f"MultiLoRA slot {slot} not found; slots present: {found}", slot=slot)
        raise UnknownAdapterNameError(
            "the shards hold no Megatron-Bridge LoRA weights ('...adapter.linear_in/linear_out.weight')"
        )
    return entries


def _check_name(name: str, rule: ModuleRule, sub: str | None, geometry: Geometry, lora_type: str) -> None:
    if lora_type == "lora" and sub is not None:
        raise ConfigError(f"{name!r} is a CanonicalLoRA sub-adapter; export with lora_type='canonical_lora'")
    if lora_type == "canonical_lora" and rule.subs and sub is None:
        raise ConfigError(f"{name!r} is a fused LoRA adapter; export with lora_type='lora'")
    if rule.experts and not geometry.experts:
        raise GeometryError(f"{name!r} is an expert adapter but the base config has no MoE experts")
    if (rule.experts or rule.megatron == "mlp.router") and geometry.model_type not in MOE_MODEL_TYPES | {""}:
        raise UnknownModuleError(
            f"{name!r}: HF model type {geometry.model_type!r} names its MoE modules differently from "
            f"{sorted(MOE_MODEL_TYPES)} ('mlp.experts.{{E}}.gate_proj', 'mlp.gate'); exclude expert "
            "and router adapters or extend lorasync.exporters.megatron._names",
            key=name,
        )


def _span(stage: range) -> str:
    return f"{stage.start}..{stage.stop - 1}" if stage else f"none (it starts at {stage.start} and is empty)"


def _label(layer: int, rule: ModuleRule, expert: int | None, sub: str | None) -> str:
    tail = f"[expert {expert}]" if expert is not None else ""
    path = rule.megatron.replace("{e}", "*")  # the local index differs per EP rank; the tail names the expert
    return f"decoder.layers.{layer}.{path}{tail}.adapter{f'.{sub}' if sub else ''}"


def _global_expert(local: int | None, ep: int, grid: Grid, geometry: Geometry, name: str) -> int:
    if not geometry.experts:
        raise GeometryError(f"{name!r} is an expert adapter but the base config has no MoE experts")
    if geometry.experts % grid.ep:
        raise GeometryError(f"{geometry.experts} experts do not split over EP={grid.ep}")
    per_rank = geometry.experts // grid.ep
    assert local is not None
    if local >= per_rank:
        raise GeometryError(f"{name!r}: local expert {local} but EP={grid.ep} leaves {per_rank} experts per rank")
    return ep * per_rank + local


def _factor(key: tuple[Any, ...], entry: Mapping[str, Any], grid: Grid) -> FactorPlan:
    layer, _, _, _, side = key
    rule: ModuleRule = entry["rule"]
    names: dict[tuple[int, int], str] = entry["names"]
    meta: dict[tuple[int, int], tuple[tuple[int, ...], torch.dtype]] = entry["meta"]
    pp, vp = entry["stage"]
    ndim = len(next(iter(meta.values()))[0])
    if ndim == 3 and rule.experts != "grouped" or ndim not in (2, 3):
        example = next(iter(names.values()))
        raise GeometryError(f"{example!r} is {ndim}-D; only grouped expert adapters may be 3-D [experts, ...]")
    tp_dim: int | None
    if rule.parallel == "replicated":
        tp_dim = None
    else:
        tp_dim = -1 if (side == "A" and rule.parallel == "row") else -2
    complete = [e for e in range(grid.ep) if all((t, e) in names for t in range(grid.tp))]
    mode: EpMode
    if rule.experts == "sequential":
        mode, eps = "own", tuple(sorted({e for _, e in names}))
    elif rule.experts == "grouped" and ndim == 3:
        mode, eps = "cat", tuple(range(grid.ep))
    else:
        mode, eps = "replicated", tuple(complete)
    need = [(t, e) for e in (eps or (0,)) for t in range(grid.tp)]
    for t, e in need:
        if (t, e) not in names:
            example = next(iter(names.values()))
            raise MissingShardError(
                f"shard {_shard_label((pp, t, e, vp))} lacks {example!r} (or its equivalent); "
                "every TP rank of a stage must hold every adapter tensor",
                shard=(pp, t, e, vp),
            )
    shapes = {meta[c] for c in need}
    if len(shapes) != 1:
        detail = ", ".join(f"tp={t} ep={e}: {list(meta[(t, e)][0])} {meta[(t, e)][1]}" for t, e in need)
        raise GeometryError(
            f"{names[need[0]]!r} differs in shape or dtype across ranks ({detail}); shards of one "
            "tensor must be equal-sized (is r or a size not divisible by TP?)"
        )
    shape, dtype = shapes.pop()
    full = list(shape)
    if tp_dim is not None:
        full[tp_dim] *= grid.tp
    if mode == "cat":
        full[0] *= grid.ep
    return FactorPlan(side, (pp, vp), dict(names), grid.tp, tp_dim, mode, eps, shape, tuple(full), dtype)


def _check_module(plan: ModulePlan, grid: Grid, geometry: Geometry) -> None:
    a, b, rule, tp = plan.a, plan.b, plan.rule, grid.tp
    if rule.experts and rule.parallel == "row" and tp > 1:
        # Measured on Megatron-Core 0.19 / Megatron-Bridge 0.6: the expert row-parallel path skips the
        # all-reduce between linear_in and linear_out (TP·s·blockdiag(B_t·A_t), not s·B·A).
        raise InexactExportError(
            f"{plan.label}: an expert linear_fc2 LoRA trained at expert-TP={tp} is not a standard "
            f"LoRA (Megatron computes {tp}·scale·blockdiag(B_t·A_t) because its expert row-parallel "
            "path skips the all-reduce between A and B), so no PEFT adapter of this rank reproduces "
            "it; train expert linear_fc2 adapters at expert_tensor_parallel_size=1, or leave them out "
            "of the LoRA targets"
        )
    if a.stage != b.stage:
        raise GeometryError(f"{plan.label}: linear_in and linear_out come from different pipeline stages")
    if len(a.full_shape) != len(b.full_shape):
        raise GeometryError(f"{plan.label}: linear_in is {a.full_shape} but linear_out is {b.full_shape}")
    if a.dtype != b.dtype:
        raise GeometryError(f"{plan.label}: linear_in is {a.dtype} but linear_out is {b.dtype}; export one dtype")
    r = b.full_shape[-1]
    if rule.parallel == "column" and r % tp:
        raise GeometryError(
            f"{plan.label}: rank r={r} is not divisible by TP={tp}; Megatron shards a column-parallel "
            "lora_A on the rank axis, so r must be a multiple of TP"
        )
    if a.full_shape[-2] != r:
        sharding = " (column-parallel A must be sharded on its rank axis, [r/TP, in] per rank)" if tp > 1 else ""
        raise GeometryError(
            f"{plan.label}: gathered linear_in has rank {a.full_shape[-2]} but linear_out has {r}{sharding}"
        )
    a_in, b_out = factor_dims(rule, plan.sub, geometry)
    if a.full_shape[-1] != a_in or b.full_shape[-2] != b_out:
        raise GeometryError(
            f"{plan.label}: gathered shapes A {list(a.full_shape)} / B {list(b.full_shape)} do not fit the base "
            f"model (A in_features {a_in}, B out_features {b_out}) at TP={tp}; check base_config and that "
            "all TP ranks are present (tp_size=)"
        )
    if len(a.full_shape) == 3 and (a.full_shape[0] != geometry.experts or b.full_shape[0] != geometry.experts):
        raise GeometryError(
            f"{plan.label}: packed expert adapters hold {a.full_shape[0]} experts after the EP gather, "
            f"the base model has {geometry.experts}"
        )
    if rule.fused == "qkv" and plan.sub is None:
        geometry.check_tp(tp)
    if rule.fused == "fc1" and plan.sub is None and b_out % (2 * tp):
        raise GeometryError(f"{plan.label}: intermediate size {b_out // 2} is not divisible by TP={tp}")
