"""Shared helpers of these repros: the engines and the trainer of tests/reliability/test_cancel_without_probe.py."""
from __future__ import annotations

import asyncio

import torch

from tests.reliability.test_cancel_without_probe import PROMPT, BusyPeftEngine, GatedEngine, lora_state, step, trainer  # noqa: F401 - shared with the tests


def served(engine, name):
    """The LoRA tensors ``engine`` serves under ``name`` (None: it does not serve it)."""
    with engine._lock:
        slot = engine._slots.get(name)
        if slot is None:
            return None
        return {n.replace(f".{slot}.", "."): p.detach().clone() for n, p in engine.model.named_parameters() if f".{slot}." in n}


def same(a, b):
    return a is not None and b is not None and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


async def until(pred, timeout=10.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        if loop.time() > end:
            raise AssertionError("timed out waiting")
        await asyncio.sleep(0.005)
