"""Shared helpers (copied from tests/reliability/test_cancel_without_probe.py)."""
from __future__ import annotations

import asyncio
import sys
import threading



import torch  # noqa: E402

from lorasync.engines.peft import PeftEngine  # noqa: E402
from lorasync.testing import MemoryEngine, make_peft_model, make_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 230, 41]


def lora_state(model):
    return {n.replace(".default.", "."): p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


def served(engine, name):
    with engine._lock:
        slot = engine._slots.get(name)
        if slot is None:
            return None
        return {n.replace(f".{slot}.", "."): p.detach().clone() for n, p in engine.model.named_parameters() if f".{slot}." in n}


def same(a, b):
    return a is not None and b is not None and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def trainer(seed=3):
    policy = make_peft_model(make_tiny_model(seed=0), seed=seed)
    return policy, torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)


def step(policy, optimizer, seed):
    g = torch.Generator().manual_seed(seed)
    for p in policy.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g)
    optimizer.step()
    optimizer.zero_grad()


class BusyPeftEngine(PeftEngine):
    """Once armed, its tensor load or swap first waits (before touching anything) until go."""

    armed = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.entered, self.go = threading.Event(), threading.Event()

    def _busy(self):
        if self.armed:
            self.entered.set()
            self.go.wait(30)

    def replace_adapter_tensors(self, name, adapter):
        self._busy()
        return super().replace_adapter_tensors(name, adapter)

    def load_adapter_tensors(self, name, adapter):
        self._busy()
        return super().load_adapter_tensors(name, adapter)


class GatedEngine(MemoryEngine):
    armed = False

    def __init__(self):
        super().__init__(weight_update=True, tensor_load=False)
        self.entered, self.go = threading.Event(), threading.Event()

    def end_weight_update(self):
        if self.armed:
            self.entered.set()
            self.go.wait(30)


async def until(pred, timeout=10.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        if loop.time() > end:
            raise AssertionError("timed out waiting")
        await asyncio.sleep(0.005)
