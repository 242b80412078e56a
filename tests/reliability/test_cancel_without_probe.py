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
from lorasync.testing import make_peft_model, make_tiny_model

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


@pytest.mark.parametrize("in_place", [False, True], ids=["versioned", "in_place"])
def test_a_cancel_during_a_tensor_delivery_never_serves_the_trainers_next_step(in_place: bool) -> None:
    async def run() -> None:
        policy, optimizer = trainer()
        engine = BusyPeftEngine(make_tiny_model(seed=0))
        async with Publisher([engine], name="policy", transport="ipc", in_place=in_place) as pub:
            step(policy, optimizer, 1)
            v1 = lora_state(policy)
            assert (await pub.apublish(fsdp.export(policy), version=1)).ok
            step(policy, optimizer, 2)
            v2 = lora_state(policy)
            engine.armed = True
            task = asyncio.ensure_future(pub.apublish(fsdp.export(policy), version=2))
            while not engine.entered.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.sleep(0.2)
            assert not task.done()  # the cancel waits for the delivery it cannot stop
            engine.armed = False
            engine.go.set()  # the generation ends; the delivery goes on and lands
            with pytest.raises(asyncio.CancelledError):
                await task
            step(policy, optimizer, 3)  # the trainer goes on only now
            name = "policy" if in_place else "policy@v2"
            assert same(served(engine, name), v2)  # what was published when it was cancelled, exactly
            if not in_place:
                assert same(served(engine, "policy@v1"), v1)
                with pub.lease(2) as leased:
                    assert leased == "policy@v2"
            step(policy, optimizer, 4)
            v4 = lora_state(policy)
            report = await pub.apublish(fsdp.export(policy), version=4)  # the run goes on
            assert report.ok and same(served(engine, report.served_name), v4)

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
