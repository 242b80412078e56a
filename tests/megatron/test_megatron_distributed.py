"""Online export under real torch.distributed (gloo, CPU, 4 processes) equals the offline export.

One spawn of 4 ranks runs every layout (process start-up dominates the cost on a small box).
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from _megatron_dist_worker import run
from _shard_builder import build_shards, config, make_peft
from safetensors.torch import load_file

from lorasync.exporters.megatron import export

DEADLINE_S = 60
LAYOUTS = {
    # TP2 x PP2, padded slot trimmed, dst on the last stage (stage 0 reaches it point-to-point);
    # then two faulty calls in the same processes: a tensor missing on rank 1, trained padding on rank 0.
    "tp2-pp2": {"tp": 2, "pp": 2, "config": config(layers=4), "r": 5, "max_rank": 8, "rank": 5, "dst": 3,
                "faults": ["missing", "padding"]},
    # TP2 x EP2 with packed per-expert adapters (EP all-gather) and a column-parallel router; expert
    # down_proj left out (refused at expert-TP 2)
    "tp2-ep2-moe": {"tp": 2, "pp": 1, "ep": 2, "experts": "grouped", "config": config(experts=4), "r": 8, "dst": 0,
                    "expert_down": False},
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def online(tmp_path_factory):
    """Run all layouts on 4 gloo ranks; returns {layout id: output dir}."""
    out = tmp_path_factory.mktemp("online")
    start = time.monotonic()
    ctx = mp.start_processes(
        run, args=(4, _free_port(), list(LAYOUTS.values()), str(out)), nprocs=4, join=False, start_method="spawn"
    )
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() - start > DEADLINE_S:
                pytest.fail(f"online export did not finish in {DEADLINE_S} s")
    except mp.ProcessRaisedException as exc:
        errors = "\n".join(p.read_text() for p in sorted(out.glob("error-*.txt")))
        pytest.fail(f"a rank failed:\n{errors or exc}")
    finally:
        for process in ctx.processes:  # only the processes this fixture started
            if process.is_alive():
                process.kill()
    assert time.monotonic() - start < DEADLINE_S
    return {name: out / str(i) for i, name in enumerate(LAYOUTS)}


def _offline(layout: dict):
    cfg = layout["config"]
    peft = make_peft(
        cfg, r=layout["r"], seed=21, same_experts=layout.get("experts") == "shared",
        expert_down=layout.get("expert_down", True),
    )
    shards = build_shards(
        peft, cfg, tp=layout["tp"], pp=layout["pp"], ep=layout.get("ep", 1),
        experts=layout.get("experts", "sequential"), max_rank=layout.get("max_rank"),
    )
    return peft, export(shards, base_config=cfg, alpha=16, rank=layout.get("rank"))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_online_equals_offline(online, name):
    layout, out = LAYOUTS[name], online[name]
    got = load_file(str(out / "adapter.safetensors"))
    peft, offline = _offline(layout)
    assert sorted(got) == sorted(offline.tensors) == sorted(peft)
    for key, tensor in offline.tensors.items():
        assert torch.equal(got[key], tensor), key
        assert torch.equal(got[key], peft[key]), key
    assert json.loads((out / "config.json").read_text()) == offline.config.to_dict()


def test_bad_input_fails_on_every_rank_without_hanging(online):
    out = online["tp2-pp2"]
    outcome = {f: [(out / f"{f}-{r}.txt").read_text() for r in range(4)] for f in ("missing", "padding")}
    assert outcome["missing"] == ["MissingShardError"] * 4  # the plan is the same everywhere
    assert outcome["padding"] == ["none", "none", "none", "PaddedRankError"]  # only dst sees values
