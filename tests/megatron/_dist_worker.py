"""Worker for the online-export test: one process per rank, real gloo process groups.

Every rank rebuilds the same shards (deterministic seed), keeps only its own, and calls
``export_distributed``; rank ``dst`` saves what it got for the parent to compare.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback


def run(rank: int, world: int, port: int, layout: dict, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from _shard_builder import build_shards, make_peft
    from safetensors.torch import save_file

    from lorasync.exporters.megatron import export_distributed

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=40),
        )
        tp, pp, ep = layout["tp"], layout["pp"], layout.get("ep", 1)
        # rank = (pp * ep + e) * tp + t: TP fastest, as in Megatron's default order
        coords = {r: (r // (tp * ep), r % tp, (r // tp) % ep) for r in range(world)}
        groups = {}
        for axis, index in (("tp", 1), ("pp", 0), ("ep", 2)):
            seen = set()
            for r in range(world):
                key = tuple(c for i, c in enumerate(coords[r]) if i != index)
                if key in seen:
                    continue
                seen.add(key)
                members = [m for m in range(world) if tuple(c for i, c in enumerate(coords[m]) if i != index) == key]
                group = dist.new_group(members)  # every rank creates every group, same order
                if rank in members:
                    groups[axis] = group
        cfg = layout["config"]
        peft = make_peft(cfg, r=layout["r"], seed=21, same_experts=layout.get("experts") == "shared")
        shards = build_shards(
            peft, cfg, tp=tp, pp=pp, ep=ep, experts=layout.get("experts", "sequential"), max_rank=layout.get("max_rank")
        )
        p, t, e = coords[rank]
        mine = shards[(p, t, e) if ep > 1 else (p, t)]
        adapter = export_distributed(
            mine,
            base_config=cfg,
            alpha=16,
            rank=layout.get("rank"),
            tp_group=groups["tp"] if tp > 1 else None,
            pp_group=groups["pp"] if pp > 1 else None,
            ep_group=groups["ep"] if ep > 1 else None,
            dst=layout["dst"],
        )
        if rank == layout["dst"]:
            save_file(dict(adapter.tensors), os.path.join(out_dir, "adapter.safetensors"))
            with open(os.path.join(out_dir, "config.json"), "w") as fh:
                json.dump(adapter.config.to_dict(), fh)
        elif adapter is not None:
            raise AssertionError(f"rank {rank} is not dst but got an adapter")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as fh:
            fh.write(traceback.format_exc())
        raise
