"""Worker for tests/distributed/test_distributed_fleet_attack.py: 2 gloo ranks on one node, rank 0
(src, the leader) with an in-memory engine. src passes something that is not an adapter (a
model's name) for one tenant: that used to raise an AttributeError on src alone, before the round
was broadcast, so rank 1 took src's next call for this one and the ranks fell out of step."""

from __future__ import annotations

import datetime
import json
import os
import time

from _dist_publish_worker import _finish, _init, _reported_errors


def run_not_an_adapter(rank: int, world: int, port: int, out: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ.pop("GROUP_RANK", None)
    with _reported_errors(out, rank):
        dist = _init(rank, world, port)
        from lorasync.distributed import DistributedFleet
        from lorasync.testing import MemoryEngine
        from lorasync.testing._conformance import tiny_llama_adapter

        engine = MemoryEngine() if rank == 0 else None
        fleet = DistributedFleet(engines=[engine] if engine else [], root=os.path.join(out, "root"), timeout=datetime.timedelta(seconds=30))
        for name in ("a", "b"):
            fleet.register(name, keep=1)
        outcome = {}
        for tag, adapters in (("typo", {"a": "policy-model", "b": tiny_llama_adapter(seed=2)}), ("next", {"a": tiny_llama_adapter(seed=1)})):
            start = time.monotonic()
            try:
                report = fleet.publish(adapters if rank == 0 else None, versions=dict.fromkeys(adapters, 1) if rank == 0 else None)
                got = None if report is None else {n: [t.status, type(t.error).__name__ if t.error else None] for n, by_node in report.tenants.items() for t in by_node.values()}
                outcome[tag] = {"raised": None, "report": got}
            except Exception as exc:
                outcome[tag] = {"raised": f"{type(exc).__module__}.{type(exc).__name__}"}
            outcome[tag]["seconds"] = time.monotonic() - start
        outcome["served"] = sorted(engine.list_adapters()) if engine else None
        with open(os.path.join(out, f"outcome-{rank}.json"), "w") as fh:
            json.dump(outcome, fh)
        fleet.close()
        _finish(dist)


def run_undecodable(rank: int, world: int, port: int, out: str) -> None:
    """2 nodes of one rank each, rank 1's leader unable to decode tenant a's bytes in the first
    round: a fails on node 1 alone, b publishes everywhere, and the next round is in step."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["LOCAL_RANK"] = "0"
    os.environ["GROUP_RANK"] = str(rank)
    with _reported_errors(out, rank):
        dist = _init(rank, world, port)
        import lorasync.distributed.fleet as dfleet
        from lorasync.distributed import DistributedFleet
        from lorasync.testing import MemoryEngine
        from lorasync.testing._conformance import tiny_llama_adapter

        if rank == 1:
            real, calls = dfleet.decode_adapter, []

            def flaky(payload):  # a's bytes in the first round: a torn buffer, say
                calls.append(1)
                if len(calls) == 1:
                    raise ValueError("not a lorasync adapter payload")
                return real(payload)

            dfleet.decode_adapter = flaky
        engine = MemoryEngine()
        fleet = DistributedFleet(engines=[engine], root=os.path.join(out, f"root{rank}"), timeout=datetime.timedelta(seconds=30))
        for name in ("a", "b"):
            fleet.register(name, keep=1)
        outcome = {}
        rounds = (("first", {"a": tiny_llama_adapter(seed=1), "b": tiny_llama_adapter(seed=2)}, 1), ("next", {"a": tiny_llama_adapter(seed=1), "b": tiny_llama_adapter(seed=2)}, 2))
        for tag, adapters, version in rounds:
            start = time.monotonic()
            try:
                report = fleet.publish(adapters if rank == 0 else None, versions=dict.fromkeys(adapters, version) if rank == 0 else None)
                got = None if report is None else {f"{n}/{node}": [t.status, type(t.error).__name__ if t.error else None] for n, by_node in report.tenants.items() for node, t in by_node.items()}
                outcome[tag] = {"raised": None, "report": got}
            except Exception as exc:
                outcome[tag] = {"raised": f"{type(exc).__module__}.{type(exc).__name__}: {exc}"}
            outcome[tag]["seconds"] = time.monotonic() - start
        outcome["served"] = sorted(engine.list_adapters())
        with open(os.path.join(out, f"outcome-{rank}.json"), "w") as fh:
            json.dump(outcome, fh)
        fleet.close()
        _finish(dist)


def run_unchanged_with_probe(rank: int, world: int, port: int, out: str, base: str) -> None:
    """2 nodes of one rank each (PEFT engines): tenant a's content at v1, then the same content
    as v2 with a probe its adapter fails, then as v3 with one it passes. "unchanged" counts only
    after the probe passes, as in a plain Fleet (before, the unchanged tenant was skipped by its
    hash on src and its probe never ran)."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["LOCAL_RANK"] = "0"
    os.environ["GROUP_RANK"] = str(rank)
    with _reported_errors(out, rank):
        dist = _init(rank, world, port)
        from lorasync import Probe
        from lorasync.distributed import DistributedFleet
        from lorasync.engines.peft import PeftEngine
        from lorasync.exporters.fsdp import export
        from lorasync.testing import make_peft_model, make_tiny_model

        model = make_peft_model(make_tiny_model(), r=8, alpha=16, seed=1, std=0.05)
        good = Probe.from_model(model, [5, 17, 99, 230], max_tokens=4)
        bad = Probe(good.prompt_ids, tuple((t + 1) % 500 + 4 for t in good.expected_ids))  # tokens the adapter never produces
        engine = PeftEngine(base_model_path=base, max_loras=3)
        fleet = DistributedFleet(engines=[engine], root=os.path.join(out, f"root{rank}"), timeout=datetime.timedelta(seconds=60))
        fleet.register("a", keep=1)
        outcome = {}
        for tag, version, probe in (("first", 1, None), ("bad", 2, bad), ("good", 3, good)):
            report = fleet.publish({"a": export(model, copy=True)} if rank == 0 else None, versions={"a": version} if rank == 0 else None,
                                   verify=None if rank != 0 or probe is None else {"a": probe})  # fmt: skip
            if report is not None:
                outcome[tag] = {node: [t.status, t.version, type(t.error).__name__ if t.error else None] for node, t in report.tenants["a"].items()}
            outcome[f"{tag}-served"] = sorted(engine.list_adapters())
        with open(os.path.join(out, f"outcome-{rank}.json"), "w") as fh:
            json.dump(outcome, fh)
        fleet.close()
        _finish(dist)
