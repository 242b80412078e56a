"""A publish cancelled without a probe (outside attack, issue 35 session of 2026-12-07), on the
in-process PEFT engine: what it serves is read from its own parameters and compared exactly.

* The delivery's engine call runs on in its thread after a cancel. Where it reads the trainer's
  own tensors (a no-copy export over tensors) or swaps the name in place, the cancel used to
  return at once, the trainer stepped, and the call then served that step: weights no publish
  produced. The cancel now waits for the delivery and keeps it when it holds what was published.
* In place, a failed take-out forgot which version served, and an older step was accepted.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from lorasync import Probe, Publisher
from lorasync.engines.peft import PeftEngine
from lorasync.errors import EngineUnavailableError, StaleVersionError
from lorasync.exporters import fsdp
from lorasync.testing import MemoryEngine, make_peft_model, make_tiny_model

PROMPT = [5, 17, 99, 230, 41]


def lora_state(model) -> dict[str, torch.Tensor]:
    return {n.replace(".default.", "."): p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


def served(engine: PeftEngine, name: str) -> dict[str, torch.Tensor]:
    with engine._lock:
        slot = engine._slots.get(name)
        assert slot is not None, f"{name} is not served"
        return {n.replace(f".{slot}.", "."): p.detach().clone() for n, p in engine.model.named_parameters() if f".{slot}." in n}


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def trainer(seed: int = 3):
    policy = make_peft_model(make_tiny_model(seed=0), seed=seed)
    return policy, torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)


def step(policy, optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in policy.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g)
    optimizer.step()
    optimizer.zero_grad()


class BusyPeftEngine(PeftEngine):
    """Once armed, its tensor load or swap first waits while a rollout's generation runs."""

    armed = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.entered, self.go = threading.Event(), threading.Event()

    def _busy(self) -> None:
        if self.armed:
            self.entered.set()
            self.go.wait(30)

    def replace_adapter_tensors(self, name, adapter):
        self._busy()
        return super().replace_adapter_tensors(name, adapter)

    def load_adapter_tensors(self, name, adapter):
        self._busy()
        return super().load_adapter_tensors(name, adapter)


def test_a_cancel_during_an_in_place_swap_never_serves_the_trainers_next_step() -> None:
    # The cancel returned at once, the trainer stepped, and the swap still running copied that
    # step into the name every request uses. It now waits for the swap and keeps it (exact).
    async def run() -> None:
        policy, optimizer = trainer()
        engine = BusyPeftEngine(make_tiny_model(seed=0))
        async with Publisher([engine], name="policy", transport="ipc", in_place=True) as pub:
            step(policy, optimizer, 1)
            assert (await pub.apublish(fsdp.export(policy), version=1)).ok
            step(policy, optimizer, 2)
            v2 = lora_state(policy)
            engine.armed = True
            task = asyncio.ensure_future(pub.apublish(fsdp.export(policy), version=2))
            while not engine.entered.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.sleep(0.2)
            assert not task.done()  # the cancel waits for the swap it cannot stop
            engine.armed = False
            engine.go.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            step(policy, optimizer, 3)  # the trainer goes on only now
            assert same(served(engine, "policy"), v2)  # what was published when it was cancelled, exactly
            with pub.lease(2) as leased:  # recorded: served as published
                assert leased == "policy"
            step(policy, optimizer, 4)
            v4 = lora_state(policy)
            assert (await pub.apublish(fsdp.export(policy), version=4)).ok  # the run goes on
            assert same(served(engine, "policy"), v4)

    asyncio.run(run())


def test_a_versioned_load_left_running_by_a_cancel_is_never_leased_and_goes_at_the_next_publish() -> None:
    # A cancel does not wait for a versioned load (the next publish does, bounded): the load left
    # running may copy the trainer's next step under policy@v2, a name no report gave out. lease(2)
    # handed it out; it refuses now, and the next publish takes the name out first.
    from lorasync.errors import VerificationError

    async def run() -> None:
        policy, optimizer = trainer()
        engine = BusyPeftEngine(make_tiny_model(seed=0))
        async with Publisher([engine], name="policy", transport="ipc") as pub:
            step(policy, optimizer, 1)
            v1 = lora_state(policy)
            assert (await pub.apublish(fsdp.export(policy), version=1)).ok
            step(policy, optimizer, 2)
            engine.armed = True
            task = asyncio.ensure_future(pub.apublish(fsdp.export(policy), version=2))
            while not engine.entered.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task  # at once: the trainer is not held
            step(policy, optimizer, 3)
            engine.armed = False
            engine.go.set()
            await asyncio.sleep(0.3)  # the load left running lands, with whatever it read
            with pytest.raises(VerificationError, match="cancelled"):
                with pub.lease(2):
                    pass
            step(policy, optimizer, 4)
            v4 = lora_state(policy)
            report = await pub.apublish(fsdp.export(policy), version=4)
            await report.asettled()
            assert report.ok and same(served(engine, "policy@v4"), v4)
            assert "policy@v2" not in engine.list_adapters()
            assert same(served(engine, "policy@v1"), v1)

    asyncio.run(run())


class Flaky(PeftEngine):
    """Goes down for a moment once armed: the probe's generate fails, then the take-out."""

    armed = False
    down = False

    def greedy(self, *args, **kwargs):
        if self.armed:
            self.down = True
            raise EngineUnavailableError("engine restarting")
        return super().greedy(*args, **kwargs)

    def replace_adapter_tensors(self, name, adapter):
        if self.down:
            raise EngineUnavailableError("engine restarting")
        return super().replace_adapter_tensors(name, adapter)

    def unload_adapter(self, name):
        if self.down:
            raise EngineUnavailableError("engine restarting")
        return super().unload_adapter(name)


def test_in_place_an_older_step_is_refused_after_a_failed_take_out() -> None:
    policy, optimizer = trainer()
    engine = Flaky(make_tiny_model(seed=0))
    with Publisher([engine], name="policy", transport="ipc", in_place=True) as pub:
        step(policy, optimizer, 1)
        assert pub.publish(fsdp.export(policy), version=5, verify=Probe.from_model(policy, PROMPT, max_tokens=4)).ok
        step(policy, optimizer, 2)
        engine.armed = True
        assert not pub.publish(fsdp.export(policy), version=6, verify=Probe.from_model(policy, PROMPT, max_tokens=4)).ok
        engine.armed = engine.down = False  # back; what serves is unknown (v5 or v6)
        old, _ = trainer(seed=11)
        before = served(engine, "policy")
        report = pub.publish(fsdp.export(old), version=3)
        assert isinstance(report.results[0].error, StaleVersionError)
        assert same(served(engine, "policy"), before)  # nothing changed
        step(policy, optimizer, 3)
        newer = lora_state(policy)
        assert pub.publish(fsdp.export(policy), version=7).ok  # newer steps go on
        assert same(served(engine, "policy"), newer)


class GatedEngine(MemoryEngine):
    """Closing the weight-update gate takes a moment once armed."""

    armed = False

    def __init__(self) -> None:
        super().__init__(weight_update=True, tensor_load=False)
        self.entered, self.go = threading.Event(), threading.Event()

    def end_weight_update(self) -> None:
        if self.armed:
            self.entered.set()
            self.go.wait(30)


def test_a_merge_cancelled_as_it_closes_the_gate_is_recorded_not_forgotten(tmp_path) -> None:
    # The merge had landed, the publisher still recorded the previous one, and a later publish of
    # the previous content was reported "unchanged" while the engine served the cancelled merge.
    async def run() -> None:
        base_dir = tmp_path / "base"
        make_tiny_model(base_dir)
        v1 = fsdp.export(make_peft_model(make_tiny_model(seed=0), seed=1), copy=True)
        v2 = fsdp.export(make_peft_model(make_tiny_model(seed=0), seed=2), copy=True)
        engine = GatedEngine()
        async with Publisher([engine], name="pol", transport="merged", base=base_dir, root=tmp_path / "store") as pub:
            assert (await pub.apublish(v1, version=1)).ok
            w1 = {k: v.clone() for k, v in engine.weights.items()}
            engine.armed = True
            task = asyncio.ensure_future(pub.apublish(v2, version=2))
            while not engine.entered.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.sleep(0.1)
            engine.armed = False
            engine.go.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not same(dict(engine.weights), w1)  # v2's merge serves, recorded as such
            report = await pub.apublish(v1, version=3)
            assert report.ok and report.results[0].status == "loaded"  # moved again: not "unchanged"
            assert same(dict(engine.weights), w1)

    asyncio.run(run())


class SwappingPeftEngine(BusyPeftEngine):
    """Says when its in-place swap is done."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.swapped = threading.Event()

    def replace_adapter_tensors(self, name, adapter):
        armed = self.armed
        super().replace_adapter_tensors(name, adapter)
        if armed:
            self.swapped.set()


def test_a_cancel_during_the_take_out_of_a_torn_swap_waits_for_it() -> None:
    # In place, no probe: the trainer stepped while the engine swapped (torn); the take-out that
    # followed was abandoned by a cancel a few loop turns later, and the name served the
    # trainer's next step. Swept over the loop turns after the swap (outside attack).
    async def attempt(spins: int) -> None:
        policy, optimizer = trainer()
        engine = SwappingPeftEngine(make_tiny_model(seed=0))
        async with Publisher([engine], name="policy", transport="ipc", in_place=True) as pub:
            step(policy, optimizer, 1)
            v1 = lora_state(policy)
            assert (await pub.apublish(fsdp.export(policy), version=1)).ok
            step(policy, optimizer, 2)
            v2 = lora_state(policy)
            engine.armed = True
            task = asyncio.ensure_future(pub.apublish(fsdp.export(policy), version=2))
            while not engine.entered.is_set():
                await asyncio.sleep(0.005)
            step(policy, optimizer, 3)  # lands while the engine is about to swap: torn
            engine.go.set()
            while not engine.swapped.is_set():
                await asyncio.sleep(0)
            for _ in range(spins):
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises((asyncio.CancelledError, Exception)):
                await task
            with engine._lock:
                slot = engine._slots.get("policy")
            # Unloaded (v1's tensors moved on and no probe kept a copy) or v1: never what no publish produced.
            assert slot is None or same(served(engine, "policy"), v1), spins
            assert slot is None or not same(served(engine, "policy"), v2)

    async def sweep() -> None:
        for spins in range(0, 12):
            await attempt(spins)

    asyncio.run(sweep())
