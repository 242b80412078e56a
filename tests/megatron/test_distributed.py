"""Online export under real torch.distributed (gloo, CPU, 4 processes) equals the offline export."""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from _dist_worker import run
from _shard_builder import build_shards, config, make_peft
from safetensors.torch import load_file

from lorasync.exporters.megatron import export

DEADLINE_S = 60


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(layout: dict, out_dir) -> float:
    start = time.monotonic()
    ctx = mp.start_processes(
        run, args=(4, _free_port(), layout, str(out_dir)), nprocs=4, join=False, start_method="spawn"
    )
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() - start > DEADLINE_S:
                pytest.fail(f"online export did not finish in {DEADLINE_S} s")
    except mp.ProcessRaisedException as exc:
        errors = "\n".join(p.read_text() for p in sorted(out_dir.glob("error-*.txt")))
        pytest.fail(f"a rank failed:\n{errors or exc}")
    finally:
        for process in ctx.processes:  # only the processes this test started
            if process.is_alive():
                process.kill()
    return time.monotonic() - start


def _offline(layout: dict):
    cfg = layout["config"]
    peft = make_peft(cfg, r=layout["r"], seed=21, same_experts=layout.get("experts") == "shared")
    shards = build_shards(
        peft, cfg, tp=layout["tp"], pp=layout["pp"], ep=layout.get("ep", 1),
        experts=layout.get("experts", "sequential"), max_rank=layout.get("max_rank"),
    )
    return peft, export(shards, base_config=cfg, alpha=16, rank=layout.get("rank"))


@pytest.mark.parametrize(
    "layout",
    [
        # TP2 x PP2, padded slot trimmed, dst on the last stage (receives everything over p2p for stage 0)
        {"tp": 2, "pp": 2, "config": config(layers=4), "r": 5, "max_rank": 8, "rank": 5, "dst": 3},
        # TP2 x EP2 with packed per-expert adapters and a router
        {"tp": 2, "pp": 1, "ep": 2, "experts": "grouped", "config": config(experts=4), "r": 8, "dst": 0},
    ],
    ids=["tp2-pp2", "tp2-ep2-moe"],
)
def test_online_equals_offline(layout, tmp_path):
    elapsed = _spawn(layout, tmp_path)
    assert elapsed < DEADLINE_S
    online = load_file(str(tmp_path / "adapter.safetensors"))
    peft, offline = _offline(layout)
    assert sorted(online) == sorted(offline.tensors) == sorted(peft)
    for key, tensor in offline.tensors.items():
        assert torch.equal(online[key], tensor), key
        assert torch.equal(online[key], peft[key]), key
    assert json.loads((tmp_path / "config.json").read_text()) == offline.config.to_dict()
