"""Worker for the distributed-fleet test: 4 gloo ranks, two simulated nodes (ranks 0, 1 and 2, 3,
roles from LOCAL_RANK / LOCAL_WORLD_SIZE as torchrun sets them), each node's leader with a PEFT
engine of 3 slots over the tiny base and its own root. ``src`` (rank 0) trains three tenants; it
dumps each version's tensors and PEFT's greedy tokens, the leaders dump what each served name
serves (tensors read from the engine, and its greedy tokens), every rank what each call did.
The parent judges."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
from _dist_publish_worker import _dump, _finish, _init, _reported_errors

PROMPT = [5, 17, 99, 230, 41]


def run_fleet(rank: int, world: int, port: int, out: str, model_dir: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    os.environ["LOCAL_RANK"] = str(rank % 2)
    os.environ.pop("GROUP_RANK", None)
    with _reported_errors(out, rank):
        dist = _init(rank, world, port)
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        from lorasync import Probe
        from lorasync.distributed import DistributedFleet
        from lorasync.engines.peft import PeftEngine
        from lorasync.errors import LoraSyncError
        from lorasync.exporters.fsdp import export
        from lorasync.testing import make_peft_model
        from tests.reliability._trust import served_lora, state, step

        node = rank // 2
        engine = PeftEngine(base_model_path=model_dir, max_loras=3) if rank % 2 == 0 else None
        fleet = DistributedFleet(engines=[engine] if engine else [], root=os.path.join(out, f"root-node{node}"), timeout=datetime.timedelta(seconds=60))
        outcome: dict[str, Any] = {"rank": rank, "is_leader": fleet.is_leader, "leaders": fleet.leaders}
        models = {n: make_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), seed=s) for n, s in (("a", 1), ("b", 2), ("c", 3), ("d", 4))} if rank == 0 else {}

        def greedy(model: Any) -> list[int]:
            ids = list(PROMPT)
            with torch.no_grad():
                for _ in range(4):
                    ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            return ids[len(PROMPT) :]

        def call(tag: str, fn: Any) -> Any:
            try:
                got = fn()
                outcome[tag] = "ok"
                return got
            except LoraSyncError as exc:
                outcome[tag] = f"{type(exc).__name__}: {exc}"
                return None

        def publish(tag: str, names: list[str], version: int, verify: dict | None = None) -> None:
            adapters = {n: export(models[n], copy=True) for n in names} if rank == 0 else None
            report = call(tag, lambda: fleet.publish(adapters, versions=dict.fromkeys(names, version) if rank == 0 else None, verify=verify))
            if report is not None:
                _dump(os.path.join(out, f"{tag}-report.json"), {
                    "sent": report.sent, "bytes_sent": report.bytes_sent, "ok": report.ok,
                    "tenants": {n: {nd: [t.status, t.version, t.served_name, t.restored_on, [r.status for r in t.results]] for nd, t in nodes.items()} for n, nodes in report.tenants.items()},
                    "verified": {n: {nd: [r.ok and "verified through the engine" in r.reason for r in t.results] for nd, t in nodes.items()} for n, nodes in report.tenants.items()},
                    "errors": {n: {nd: type(t.error).__name__ for nd, t in nodes.items() if t.error is not None} for n, nodes in report.tenants.items()},
                })  # fmt: skip
            if rank == 0:
                for n in names:  # what each version must serve: the trainer's tensors, PEFT's tokens
                    save_file(state(models[n]), os.path.join(out, f"want-{n}-{version}.safetensors"))
                    _dump(os.path.join(out, f"want-{n}-{version}.json"), greedy(models[n]))
            if engine is not None:
                served = sorted(engine.list_adapters())
                _dump(os.path.join(out, f"{tag}-node{node}-served.json"), served)
                for s in served:
                    save_file(served_lora(engine, s), os.path.join(out, f"{tag}-node{node}-{s}.safetensors"))
                    _dump(os.path.join(out, f"{tag}-node{node}-{s}.json"), engine.generate(PROMPT, adapter=s, max_new_tokens=4))

        for name in "abc":
            call(f"register-{name}", lambda name=name: fleet.register(name, keep=1, grace=0.0))
        for version in (1, 2, 3):
            for i, n in enumerate(models):
                step(models[n], seed=10 * version + i)
            probes = {n: Probe.from_model(models[n], PROMPT, max_tokens=4) for n in "abc"} if rank == 0 and version == 3 else None
            publish(f"v{version}", ["a", "b", "c"], version, verify=probes)  # v3 verified through every engine
        if rank == 0:
            step(models["b"], seed=99)
        publish("only-b", ["a", "b", "c"], 4)  # a and c unchanged: not sent, versions kept
        if rank == 0:
            for n in "ac":
                step(models[n], seed=7)
        wrong = {"a": Probe.from_model(models["d"], PROMPT, max_tokens=4)} if rank == 0 else None  # another model's tokens
        publish("bad-probe", ["a", "b", "c"], 5, verify=wrong)  # a fails alone on every node, c steps
        call("register-d-full", lambda: fleet.register("d", keep=1))
        call("unknown-tenant", lambda: fleet.publish({"zz": export(models["a"], copy=True)} if rank == 0 else None, versions={"zz": 1}))
        call("retire-c", lambda: fleet.retire("c", timeout=5))
        call("register-d", lambda: fleet.register("d", keep=1, grace=0.0))
        publish("d", ["d"], 1)
        if rank == 2:  # node 1's engine restarted: it lost every adapter
            for s in engine.list_adapters():
                engine.unload_adapter(s)
        restored = call("restore", fleet.restore)
        if restored is not None:
            _dump(os.path.join(out, "restore-report.json"), {n: {nd: [t.status, t.version, t.restored_on] for nd, t in nodes.items()} for n, nodes in restored.tenants.items()})
        if engine is not None:
            _dump(os.path.join(out, f"end-node{node}-served.json"), sorted(engine.list_adapters()))
            for s in engine.list_adapters():
                save_file(served_lora(engine, s), os.path.join(out, f"end-node{node}-{s}.safetensors"))
        fleet.close()
        # A second run (the trainer restarted): the first left its current versions loaded, so the
        # names are refused on every rank until they are unloaded; then they register afresh.
        fleet = DistributedFleet(engines=[engine] if engine else [], root=os.path.join(out, f"root2-node{node}"), timeout=datetime.timedelta(seconds=60))
        call("second-register-a-still-served", lambda: fleet.register("a", keep=1))
        if engine is not None:
            for s in engine.list_adapters():
                engine.unload_adapter(s)
        call("second-register-a", lambda: fleet.register("a", keep=1))
        publish("second", ["a"], 10)  # a's newest content, in the new registration
        _dump(os.path.join(out, f"outcome-{rank}.json"), outcome)
        fleet.close()
        _finish(dist)
