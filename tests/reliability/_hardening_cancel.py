"""Cancellation injected at every await point of the merged transport on the PEFT engine
(issue 15): the engine's update gate is released on every path, so generation still finishes,
and the engine serves the previous merge or the new one bit for bit, never a mix.

Every step the transport awaits (the gate, each fold, each bucket pushed, the end) runs in a
worker thread; a hook in those threads marks the step and holds it briefly, and the driver
cancels the publishing task exactly then.
"""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from typing import Any

import torch

from lorasync import Adapter
from lorasync.transports import BaseWeights
from lorasync.transports._fold import fold_buckets
from lorasync.transports.merged import MergedTransport

PROMPT = [1, 17, 42, 99]


class _Hooks:
    """Counts the transport's threaded steps; holds step ``target`` (1-based) for a moment and
    signals it (``hit``), then does the same for ``again`` (a second cancel)."""

    def __init__(self) -> None:
        self.calls = 0
        self.targets: set[int] = set()
        self.hits = {n: threading.Event() for n in range(64)}
        self.lock = threading.Lock()

    def arm(self, *targets: int) -> None:
        with self.lock:
            self.calls, self.targets = 0, set(targets)
            self.hits = {n: threading.Event() for n in range(64)}

    def __call__(self) -> None:
        with self.lock:
            self.calls += 1
            n = self.calls
        if n in self.targets:
            self.hits[n].set()
            time.sleep(0.05)  # still running in its thread when the cancel lands


def _instrumented(hooks: _Hooks) -> tuple[Any, Any]:
    from lorasync.engines.peft import PeftEngine
    from lorasync.testing import make_tiny_model

    class HookedPeftEngine(PeftEngine):
        def begin_weight_update(self) -> None:
            hooks()
            super().begin_weight_update()

        def update_weights(self, named_tensors: Any) -> None:
            hooks()
            super().update_weights(named_tensors)

        def end_weight_update(self) -> None:
            hooks()
            super().end_weight_update()

    class HookedBase(BaseWeights):
        def get(self, name: str) -> torch.Tensor:
            hooks()
            return super().get(name)

    model = make_tiny_model(seed=0)
    base = HookedBase(tensors={k: v.detach().clone() for k, v in model.state_dict().items()})
    return HookedPeftEngine(model), base


def _adapters() -> tuple[Adapter, Adapter, Adapter]:
    from lorasync.testing import tiny_llama_adapter

    v1 = tiny_llama_adapter(seed=1, r=4, alpha=64.0)
    full = tiny_llama_adapter(seed=2, r=4, alpha=64.0)
    # v2 touches q_proj only: a roll-back must also put v1's v_proj back, a commit pristine W0.
    v2 = Adapter({k: v for k, v in full.tensors.items() if ".q_proj." in k}, full.config.with_(target_modules=()))
    v3 = tiny_llama_adapter(seed=3, r=4, alpha=64.0)
    return v1, v2, v3


def _weights(engine: Any, names: list[str]) -> dict[str, torch.Tensor]:
    return {n: engine._base_parameter(n).detach().clone() for n in names}


def run_merged_cancellation() -> dict[str, Any]:
    """``tried``: cancellations injected (every step, plus a second cancel during each roll-back);
    ``handled``: the gate was free afterwards, generation finished, the weights were exactly one
    whole version and the next publish merged exactly."""
    hooks = _Hooks()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, base = _instrumented(hooks)
    v1, v2, v3 = _adapters()
    transport = MergedTransport(base, bucket_bytes=1)  # one module per bucket: more await points
    caps = engine.capabilities()
    hooks.arm()
    names = sorted({f"{m}.weight" for m in v1.modules + v2.modules})
    pristine = {n: base.get(n).clone() for n in names}

    def expected(adapter: Adapter) -> dict[str, torch.Tensor]:
        folded = {}
        for bucket in fold_buckets(adapter, base, bucket_bytes=1 << 40):
            folded.update(bucket)
        return {n: folded.get(n, pristine[n]) for n in names}

    want = {1: expected(v1), 2: expected(v2), 3: expected(v3)}

    async def deliver(adapter: Adapter, version: int) -> Any:
        return await asyncio.wait_for(transport.deliver(adapter, engine, caps, name="p", version=version, served=""), 60)

    async def scenario(target: int, again: bool) -> list[str]:
        await deliver(v1, 1)
        hooks.arm(target, target + 1) if again else hooks.arm(target)
        task = asyncio.create_task(transport.deliver(v2, engine, caps, name="p", version=2, served=""))
        if target:
            if not await asyncio.to_thread(hooks.hits[target].wait, 30):
                return [f"step {target} never ran"]
        task.cancel()
        if again:
            if await asyncio.to_thread(hooks.hits[target + 1].wait, 5):
                task.cancel()
        problems = []
        try:
            await asyncio.wait_for(task, 30)
            problems.append("the cancelled publish returned normally")
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{type(exc).__name__}: {exc}")
        hooks.arm()
        # Generation goes through the update gate: it must finish.
        done: list[Any] = []
        thread = threading.Thread(target=lambda: done.append(engine.greedy(None, PROMPT, 2)), daemon=True)
        thread.start()
        await asyncio.to_thread(thread.join, 20)  # the loop keeps running meanwhile
        if not done:
            engine._update_gate.release()  # unwedge the engine so the run can end and report
            await asyncio.to_thread(thread.join, 20)
            return [*problems, "generation never finished: the update gate stayed held"]
        got = _weights(engine, names)
        whole = [v for v in (1, 2) if all(torch.equal(got[n], want[v][n]) for n in names)]
        if not whole:
            problems.append("the engine serves a mix of v1 and v2")
        await deliver(v3, 3)
        got = _weights(engine, names)
        if not all(torch.equal(got[n], want[3][n]) for n in names):
            problems.append("the next publish did not merge exactly")
        return problems

    async def main() -> tuple[int, int, list[str]]:
        await deliver(v1, 1)
        hooks.arm()
        await deliver(v2, 2)
        steps = hooks.calls  # await points of one publish over a previous merge
        tried = handled = 0
        violations: list[str] = []
        for target in range(steps + 1):
            for again in (False, True) if 0 < target < steps else (False,):
                tried += 1
                problems = await scenario(target, again)
                if problems:
                    label = f"cancel at step {target}/{steps}" + (" and again during the roll-back" if again else "")
                    violations.append(f"{label}: " + "; ".join(problems))
                    if any("gate" in p for p in problems):
                        return tried, handled, violations  # the engine is wedged for good
                else:
                    handled += 1
        return tried, handled, violations

    tried, handled, violations = asyncio.run(main())
    return {"tried": tried, "handled": handled, "violations": violations}
