"""Worker for the online-export test: one process per rank, real gloo process groups.

For each layout, every rank rebuilds the same shards (deterministic seed), keeps only its own and
calls ``export_distributed``; rank ``dst`` saves what it got for the parent to compare. Optional
faults then check that bad input fails on every rank instead of leaving one waiting.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback


def run(rank: int, world: int, port: int, layouts: list[dict], out_root: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=40),
        )
        for index, layout in enumerate(layouts):
            out_dir = os.path.join(out_root, str(index))
            os.makedirs(out_dir, exist_ok=True)
            _one_layout(dist, rank, world, layout, out_dir)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_root, f"error-{rank}.txt"), "w") as fh:
            fh.write(traceback.format_exc())
        raise


def _groups(dist, rank: int, world: int, tp: int, pp: int, ep: int) -> tuple[tuple[int, int, int], dict]:
    # rank = (pp * ep + e) * tp + t: TP fastest, as in Megatron's default order
    coords = {r: (r // (tp * ep), r % tp, (r // tp) % ep) for r in range(world)}
    groups = {}
    for axis, index in (("pp", 0), ("tp", 1), ("ep", 2)):
        buckets: dict[tuple[int, ...], list[int]] = {}
        for r in range(world):
            buckets.setdefault(tuple(c for i, c in enumerate(coords[r]) if i != index), []).append(r)
        for members in buckets.values():
            group = dist.new_group(members)  # every rank creates every group, in the same order
            if rank in members:
                groups[axis] = group
    sizes = {"pp": pp, "tp": tp, "ep": ep}
    return coords[rank], {axis: g if sizes[axis] > 1 else None for axis, g in groups.items()}


def _one_layout(dist, rank: int, world: int, layout: dict, out_dir: str) -> None:
    from _shard_builder import build_shards, make_peft
    from safetensors.torch import save_file

    from lorasync.exporters.megatron import export_distributed

    tp, pp, ep = layout["tp"], layout["pp"], layout.get("ep", 1)
    (p, t, e), groups = _groups(dist, rank, world, tp, pp, ep)
    cfg = layout["config"]
    peft = make_peft(
        cfg, r=layout["r"], seed=21, same_experts=layout.get("experts") == "shared",
        expert_down=layout.get("expert_down", True),
    )
    shards = build_shards(
        peft, cfg, tp=tp, pp=pp, ep=ep, experts=layout.get("experts", "sequential"), max_rank=layout.get("max_rank")
    )
    mine = shards[(p, t, e) if ep > 1 else (p, t)]

    def call(state):
        return export_distributed(
            state, base_config=cfg, alpha=16, rank=layout.get("rank"), dst=layout["dst"],
            tp_group=groups["tp"], pp_group=groups["pp"], ep_group=groups["ep"],
        )

    adapter = call(mine)
    if rank == layout["dst"]:
        save_file(dict(adapter.tensors), os.path.join(out_dir, "adapter.safetensors"))
        with open(os.path.join(out_dir, "config.json"), "w") as fh:
            json.dump(adapter.config.to_dict(), fh)
    elif adapter is not None:
        raise AssertionError(f"rank {rank} is not dst but got an adapter")

    for fault in layout.get("faults", ()):
        broken = dict(mine)
        if fault == "missing" and rank == 1:
            del broken[next(k for k in broken if k.endswith("linear_qkv.adapter.linear_in.weight"))]
        if fault == "padding" and rank == 0:
            name = next(k for k in broken if k.endswith("linear_fc2.adapter.linear_out.weight"))
            broken[name] = broken[name].clone()
            broken[name][0, -1] = 1.0
        try:
            outcome = "none" if call(broken) is None else "adapter"
        except Exception as exc:  # recorded for the parent to assert on
            outcome = type(exc).__name__
        with open(os.path.join(out_dir, f"{fault}-{rank}.txt"), "w") as fh:
            fh.write(outcome)
