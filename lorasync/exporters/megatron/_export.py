"""The offline Megatron export: every rank's state dict at once, gathered in memory (see the
package docstring for the steps)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lorasync.adapter._adapter import Adapter
from lorasync.errors import ConfigError, ExportError
from lorasync.exporters.megatron._convert import build_adapter, convert_module
from lorasync.exporters.megatron._layout import Geometry
from lorasync.exporters.megatron._names import is_adapter_name
from lorasync.exporters.megatron._inputs import Grid, ShardKey, check_options
from lorasync.exporters.megatron._plan import FactorPlan, ShardMeta, build_plan

__all__ = ["export"]


def export(
    shards: Mapping[ShardKey | tuple[int, ...], Mapping[str, torch.Tensor]],
    *,
    base_config: Any,
    rank: int | None = None,
    alpha: float,
    lora_type: str = "lora",
    slot: int | None = None,
    layer_offsets: Sequence[int] | Mapping[Any, int] | None = None,
    tp_size: int | None = None,
    pp_size: int | None = None,
    ep_size: int | None = None,
    dtype: torch.dtype | None = None,
    base_model_name_or_path: str | None = None,
) -> Adapter:
    """Build a PEFT Adapter from every rank's Megatron-Bridge adapter state dict.

    Args:
        shards (`Mapping`): ``ShardKey(pp, tp, ep, vp)`` or a tuple ``(pp, tp)``,
            ``(pp, tp, ep)``, ``(pp, tp, ep, vp)`` → that rank's state dict with Megatron-Bridge
            names and stage-local layer numbers. Leading ``module.`` prefixes, base weights
            (``.to_wrap.``) and ``_extra_state`` entries are tolerated and ignored.
        base_config (`str`, `PathLike` or `dict`): the base model's HF ``config.json`` (file,
            directory or dict): heads, KV heads, head_dim, hidden, intermediate, layers, experts.
        rank (`int`, *optional*): the trained rank. Max-rank padding beyond it is trimmed after
            proving it is zero. Defaults to the gathered width (no trimming).
        alpha (`float`): the adapter's alpha (Megatron ``alpha``; scale = alpha / rank).
        lora_type (`str`, defaults to ``"lora"``): ``"lora"`` (fused ``linear_qkv`` /
            ``linear_fc1``) or ``"canonical_lora"`` (``adapter_q/k/v``, ``adapter_gate/up``).
        slot (`int`, *optional*): MultiLoRA slot to export (``...adapters.{slot}.linear_*``).
        layer_offsets (*optional*): first global layer of each PP stage, as a sequence indexed by
            PP rank or a mapping from ``pp`` / ``(pp, vp)``; defaults to Megatron's even split.
            They must start at 0 and never decrease in pipeline order (chunk ``vp`` of PP ranks
            0, 1, ... before chunk ``vp + 1``); each stage holds the layers up to the next one's.
        tp_size, pp_size, ep_size (`int`, *optional*): the run's sizes, to detect missing
            trailing ranks; inferred from the keys otherwise. Checked against the shards given
            before anything is allocated.
        dtype (`torch.dtype`, *optional*): cast the exported tensors.
        base_model_name_or_path (`str`, *optional*): recorded in ``adapter_config.json``.

    Returns:
        `Adapter`: PEFT keys ``base_model.model.model.layers.{L}.<module>.lora_{A,B}.weight``.

    Raises:
        MissingShardError: a rank, a tensor on a rank, or one factor of an adapter is missing.
        GeometryError: shapes, TP size, head counts or layer numbering do not fit the base model;
            ``layer_offsets`` out of pipeline order, not starting at 0, or a stage's layers
            running past the next stage's first layer.
        UnknownModuleError: an adapter on a module no rule translates.
        PaddedRankError: padding beyond ``rank`` holds trained values.
        InexactExportError: DoRA magnitudes, or expert linear_fc2 adapters at expert-TP > 1
            (state that no PEFT LoRA adapter reproduces; refused, never approximated).
        ConfigError: a bool, NaN/inf, non-positive or non-integral value where a size, rank,
            slot or alpha belongs; a ``dtype`` that is not a float torch dtype; malformed keys.
        UnknownAdapterNameError: absent slot or no adapter at all.

    Example:
        >>> adapter = export({(0, 0): sd_tp0, (0, 1): sd_tp1}, base_config="base/", alpha=32, rank=16)
        >>> adapter.save("out/")
    """
    sizes = {"tp_size": tp_size, "pp_size": pp_size, "ep_size": ep_size}
    rank, alpha, slot = check_options(rank=rank, alpha=alpha, slot=slot, lora_type=lora_type, dtype=dtype, sizes=sizes)
    if not isinstance(shards, Mapping):
        raise ConfigError(f"shards must be a mapping (pp, tp[, ep[, vp]]) -> state dict, got {type(shards).__name__}")
    keyed: dict[ShardKey, Mapping[str, torch.Tensor]] = {}
    for key, state in shards.items():
        shard_key = ShardKey.of(key)
        if shard_key in keyed:
            raise ConfigError(f"shard {shard_key} is given twice (as {key!r}); pass each rank once")
        if not isinstance(state, Mapping):
            raise ConfigError(f"shard {shard_key} is a {type(state).__name__}; pass that rank's state dict (name -> tensor)")
        keyed[shard_key] = state
    grid = Grid.of_keys(keyed, tp_size=tp_size, pp_size=pp_size, ep_size=ep_size)
    geometry = Geometry.from_config(base_config)
    meta = {key: _meta(key, state) for key, state in keyed.items()}
    plan = build_plan(meta, grid, geometry, lora_type=lora_type, slot=slot, layer_offsets=layer_offsets)
    modules = {}
    for module in plan:
        a, b = _gather(keyed, module.a), _gather(keyed, module.b)
        modules.update(convert_module(module, a, b, geometry=geometry, rank=rank))
    return build_adapter(
        modules, rank=rank, alpha=alpha, dtype=dtype, base_model_name_or_path=base_model_name_or_path
    )


def _meta(key: ShardKey, state: Mapping[str, Any]) -> ShardMeta:
    out = {}
    for name, value in state.items():
        if not is_adapter_name(name):
            continue
        if not isinstance(value, torch.Tensor):
            raise ExportError(f"shard {key}: {name!r} is a {type(value).__name__}, not a tensor")
        if value.is_meta:  # a model built on the meta device holds shapes but no values
            raise ExportError(f"shard {key}: {name!r} is a meta tensor (no data); pass the materialised state dict")
        out[name] = (tuple(value.shape), value.dtype)
    return out


def _gather(shards: Mapping[ShardKey, Mapping[str, torch.Tensor]], factor: FactorPlan) -> torch.Tensor:
    pp, vp = factor.stage
    eps = factor.eps if factor.ep_mode == "cat" else factor.eps[:1]
    tps = range(factor.tp_size) if factor.tp_dim is not None else range(1)
    per_ep = []
    for ep in eps:
        parts = [shards[ShardKey(pp, tp, ep, vp)][factor.names[(tp, ep)]].detach() for tp in tps]
        per_ep.append(torch.cat(parts, dim=factor.tp_dim) if factor.tp_dim is not None else parts[0])
    return torch.cat(per_ep, dim=0) if len(per_ep) > 1 else per_ep[0]
