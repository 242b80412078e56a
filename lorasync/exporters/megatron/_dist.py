"""Online Megatron export: gather adapter shards over torch.distributed process groups to one rank.

Collective contract: **every rank of the TP × PP × EP grid calls** :func:`export_distributed`
with the same options. The ranks first exchange metadata (names, shapes, dtypes; JSON in uint8
tensors, never pickle) so each derives the same plan and rejects bad input identically before any
tensor moves. Then, one module factor at a time and in plan order, the owning stage all-gathers
the factor over its TP group (and EP group for packed experts) and one of its ranks sends the
result to ``dst`` (nothing is sent when ``dst`` took part in the gather). Peak extra memory is one
gathered factor per rank; ``dst`` also holds the growing Adapter. Errors that need tensor values
(non-zero padding) are held on ``dst`` until the protocol ends, so no rank is left waiting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lorasync.adapter._adapter import Adapter
from lorasync.runtime._collectives import all_gather_json, collective_device
from lorasync.errors import ConfigError, ExportError, LoraSyncError
from lorasync.exporters.megatron._convert import Pair, build_adapter, convert_module
from lorasync.exporters.megatron._layout import Geometry
from lorasync.exporters.megatron._names import is_adapter_name
from lorasync.exporters.megatron._inputs import Grid, ShardKey, check_options, count
from lorasync.exporters.megatron._plan import FactorPlan, build_plan

__all__ = ["export_distributed"]

Coord = tuple[int, int, int]  # (pp, tp, ep)


def export_distributed(
    local_state_dict: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
    *,
    base_config: Any,
    rank: int | None = None,
    alpha: float,
    tp_group: Any = None,
    pp_group: Any = None,
    ep_group: Any = None,
    dst: int = 0,
    lora_type: str = "lora",
    slot: int | None = None,
    layer_offsets: Sequence[int] | Mapping[Any, int] | None = None,
    dtype: torch.dtype | None = None,
    base_model_name_or_path: str | None = None,
) -> Adapter | None:
    """Export the adapter of a running Megatron job to one rank (collective).

    Args:
        local_state_dict (`Mapping` or `Sequence[Mapping]`): this rank's adapter parameters with
            Megatron-Bridge names and stage-local layer numbers (``model.state_dict()`` is fine:
            base weights are skipped); a sequence holds one state dict per virtual-pipeline chunk.
        base_config: the base model's HF ``config.json`` (path, directory or dict).
        rank, alpha, lora_type, slot, layer_offsets, dtype, base_model_name_or_path: as in
            :func:`lorasync.exporters.megatron.export`.
        tp_group, pp_group, ep_group (`ProcessGroup`, *optional*): this rank's tensor-, pipeline-
            and expert-parallel groups; None means that axis is not parallel (size 1).
        dst (`int`, defaults to 0): global rank that receives the Adapter; it must be one of the
            grid's ranks.

    Returns:
        `Adapter` on ``dst``, `None` on every other rank.

    Raises:
        ConfigError: torch.distributed is not initialised, the groups do not form a grid, or an
            option value is malformed (checked before any collective, as in ``export``).
        ExportError: a collective failed (translated from torch.distributed).
        MissingShardError, GeometryError, UnknownModuleError, PaddedRankError: as in ``export``;
            raised on every rank, except PaddedRankError, which only ``dst`` can see.
    """
    import torch.distributed as dist

    rank, alpha, slot = check_options(rank=rank, alpha=alpha, slot=slot, lora_type=lora_type, dtype=dtype)
    count("dst", dst, minimum=0, what="the global rank that receives the Adapter")
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("export_distributed needs an initialised torch.distributed process group")
    chunks = [local_state_dict] if isinstance(local_state_dict, Mapping) else list(local_state_dict)
    device = collective_device(dist)
    me: Coord = (_rank(dist, pp_group), _rank(dist, tp_group), _rank(dist, ep_group))
    geometry = Geometry.from_config(base_config)
    try:
        everyone = _exchange_meta(dist, chunks, me, device, tp_group, ep_group, pp_group)
        grid, ranks, meta = _grid(everyone, dist, pp_group, tp_group, ep_group)
        if dst not in ranks.values():
            raise ConfigError(f"dst={dst} is not a rank of the export grid {sorted(ranks.values())}")
        dst_coord = next(c for c, r in ranks.items() if r == dst)
        plan = build_plan(meta, grid, geometry, lora_type=lora_type, slot=slot, layer_offsets=layer_offsets)
        is_dst = dist.get_rank() == dst
        modules: dict[str, Pair] = {}
        deferred: LoraSyncError | None = None
        for module in plan:
            factors = [
                _move(dist, f, chunks, me, dst_coord, ranks, grid, device, tp_group, ep_group)
                for f in (module.a, module.b)
            ]
            if is_dst and deferred is None:
                a, b = (t.to("cpu") for t in factors)  # type: ignore[union-attr]  # dst always receives
                try:
                    modules.update(convert_module(module, a, b, geometry=geometry, rank=rank))
                except LoraSyncError as exc:  # keep serving the protocol, raise at the end
                    deferred = exc
    except RuntimeError as exc:  # torch.distributed errors (DistError, backend failures)
        raise ExportError(
            f"a collective failed during the Megatron export: {exc}; every rank of the TP/PP/EP grid "
            "must call export_distributed with the same options"
        ) from exc
    if not is_dst:
        return None
    if deferred is not None:
        raise deferred
    return build_adapter(modules, rank=rank, alpha=alpha, dtype=dtype, base_model_name_or_path=base_model_name_or_path)


def _rank(dist: Any, group: Any) -> int:
    return int(dist.get_rank(group)) if group is not None else 0


def _size(dist: Any, group: Any) -> int:
    return int(dist.get_world_size(group)) if group is not None else 1


def _exchange_meta(
    dist: Any, chunks: list[Mapping[str, Any]], me: Coord, device: torch.device, *groups: Any
) -> list[dict[str, Any]]:
    """Every rank's metadata on every rank: gathered over TP, then EP, then PP."""
    mine = {
        "rank": int(dist.get_rank()),
        "coord": list(me),
        "chunks": [
            {name: [list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in chunk.items()
             if is_adapter_name(name) and isinstance(t, torch.Tensor)}
            for chunk in chunks
        ],
    }
    gathered: list[Any] = [mine]
    for group in groups:
        gathered = [item for part in (all_gather_json(dist, gathered, group, device) if group is not None else [gathered]) for item in part]  # None: axis not parallel
    return gathered


def _grid(
    everyone: list[dict[str, Any]], dist: Any, pp_group: Any, tp_group: Any, ep_group: Any
) -> tuple[Grid, dict[Coord, int], dict[ShardKey, Any]]:
    vps = {len(item["chunks"]) for item in everyone}
    if len(vps) != 1:
        raise ConfigError(f"ranks hold different numbers of virtual-pipeline chunks: {sorted(vps)}")
    grid = Grid(pp=_size(dist, pp_group), tp=_size(dist, tp_group), ep=_size(dist, ep_group), vp=vps.pop())
    ranks: dict[Coord, int] = {}
    meta: dict[ShardKey, Any] = {}
    for item in everyone:
        pp, tp, ep = item["coord"]
        if (pp, tp, ep) in ranks:
            raise ConfigError(f"ranks {ranks[(pp, tp, ep)]} and {item['rank']} share (pp, tp, ep)={(pp, tp, ep)}")
        ranks[(pp, tp, ep)] = item["rank"]
        for vp, chunk in enumerate(item["chunks"]):
            meta[ShardKey(pp, tp, ep, vp)] = {
                name: (tuple(shape), getattr(torch, dtype)) for name, (shape, dtype) in chunk.items()
            }
    if len(ranks) != grid.pp * grid.tp * grid.ep:
        raise ConfigError(
            f"the TP/PP/EP groups do not form a {grid.pp}x{grid.tp}x{grid.ep} grid ({len(ranks)} ranks reached); "
            "pass this rank's tensor-, pipeline- and expert-parallel groups"
        )
    return grid, ranks, meta


def _move(
    dist: Any,
    factor: FactorPlan,
    chunks: list[Mapping[str, torch.Tensor]],
    me: Coord,
    dst: Coord,
    ranks: Mapping[Coord, int],
    grid: Grid,
    device: torch.device,
    tp_group: Any,
    ep_group: Any,
) -> torch.Tensor | None:
    """Gather one factor on its owners and deliver it to ``dst``; returns it on ``dst`` only.

    Every rank computes the same participants from the plan, so the collectives match up.
    """
    pp, vp = factor.stage
    if factor.ep_mode == "replicated":  # any complete EP replica will do; prefer dst's own
        eps = (dst[2],) if dst[0] == pp and dst[2] in factor.eps else factor.eps[:1]
    else:
        eps = factor.eps
    if factor.tp_dim is not None:
        tps: tuple[int, ...] = tuple(range(grid.tp))
    else:
        tps = (dst[1],) if dst[0] == pp and dst[2] in eps else (0,)
    participants = {(pp, t, e) for t in tps for e in eps}
    full = None
    if me in participants:
        full = chunks[vp][factor.names[(me[1], me[2])]].detach().to(device).contiguous()
        if factor.tp_dim is not None and grid.tp > 1:
            parts = [torch.empty_like(full) for _ in range(grid.tp)]
            dist.all_gather(parts, full, group=tp_group)
            full = torch.cat(parts, dim=factor.tp_dim)
        if factor.ep_mode == "cat" and grid.ep > 1:
            parts = [torch.empty_like(full) for _ in range(grid.ep)]
            dist.all_gather(parts, full, group=ep_group)
            full = torch.cat(parts, dim=0)
    if dst in participants:
        return full if me == dst else None
    sender = ranks[(pp, tps[0], eps[0])]
    if me == dst:
        buffer = torch.empty(factor.full_shape, dtype=factor.dtype, device=device)
        dist.recv(buffer, src=sender)
        return buffer
    if ranks[me] == sender:
        dist.send(full, dst=ranks[dst])
    return None
