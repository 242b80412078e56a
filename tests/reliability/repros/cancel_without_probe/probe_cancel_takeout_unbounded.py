"""BUG: a cancelled in-place publish with a probe is held far past CANCELLED_CALL_WAIT_S when the
take-out that follows the landed swap is slow: the bound is counted only from a cancel that
arrives *while* finish() waits, and the cancel was already consumed by the delivery's wait.

What the user sees: Publisher([engine], transport="ipc", in_place=True, verify=probe) on an
in-process PEFT engine. publish(v2) is cancelled (task.cancel(), or asyncio.run's Ctrl-C) during
the swap; the swap lands within the bound; withdraw_cancelled() then puts v1 back through another
swap, which waits on the engine (a long generation holds it). to_the_end(take_out) sees no new
cancel, so its bound never starts: the cancelled task does not end until the engine answers
(here 20 s, for ever on a wedged engine), holding the publisher's lock (the next publish,
aclose()) with it.
Promise broken: docs/concepts.md / _interrupted: "A cancel is held CANCELLED_CALL_WAIT_S at most";
no call hangs.

Fixed: the take-out's bound counts from the cancel it handles (finish(cancelled_at=)); past it, the
take-out is left running to the next publish like a delivery (_interrupted._settled). Then the next
publish waits for the put-back and serves its own version exactly.

Run: .venv/bin/python tests/reliability/repros/cancel_without_probe/probe_cancel_takeout_unbounded.py
"""
import asyncio
import sys
import threading
import time

sys.path.insert(0, __import__("os").path.abspath(__import__("os").path.join(__import__("os").path.dirname(__file__), "../../../..")))
import lorasync.publisher._cancelled as _cancelled  # noqa: E402

_cancelled.CANCELLED_CALL_WAIT_S = 0.5

from tests.reliability.test_cancel_without_probe import PROMPT, lora_state, step, trainer  # noqa: E402

from lorasync import Probe, Publisher  # noqa: E402
from lorasync.engines.peft import PeftEngine  # noqa: E402
from lorasync.exporters import fsdp  # noqa: E402
from lorasync.testing import make_tiny_model  # noqa: E402

HANG_S = 20.0


class SlowPutBack(PeftEngine):
    armed = False

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def replace_adapter_tensors(self, name, adapter):
        if self.armed:
            self.calls += 1
            if self.calls == 1:  # v2's swap: lands 0.2 s after the cancel (within the bound)
                self.entered.set()
                time.sleep(0.3)
            else:  # the put-back of v1: the engine is busy (a long generation)
                self.release.wait(HANG_S)
        return super().replace_adapter_tensors(name, adapter)


async def main() -> None:
    policy, optimizer = trainer()
    engine = SlowPutBack(make_tiny_model(seed=0))
    async with Publisher([engine], name="policy", transport="ipc", in_place=True) as pub:
        step(policy, optimizer, 1)
        probe1 = Probe.from_model(policy, PROMPT, max_tokens=4)
        assert (await pub.apublish(fsdp.export(policy, copy=True), version=1, verify=probe1)).ok
        step(policy, optimizer, 2)
        probe2 = Probe.from_model(policy, PROMPT, max_tokens=4)
        engine.armed = True
        task = asyncio.ensure_future(pub.apublish(fsdp.export(policy, copy=True), version=2, verify=probe2))
        while not engine.entered.is_set():
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=_cancelled.CANCELLED_CALL_WAIT_S + 3.0)
        held = time.monotonic() - t0
        print(f"cancel returned: {bool(done)} after {held:.2f} s (bound {_cancelled.CANCELLED_CALL_WAIT_S} s)")
        assert done, f"the cancel was still held {held:.1f} s after task.cancel(), bound {_cancelled.CANCELLED_CALL_WAIT_S} s"
        # The put-back still runs; the next publish waits for it (bounded), then serves v3 exactly.
        step(policy, optimizer, 3)
        probe3 = Probe.from_model(policy, PROMPT, max_tokens=4)
        asyncio.get_running_loop().call_later(0.3, engine.release.set)
        report = await pub.apublish(fsdp.export(policy, copy=True), version=3, verify=probe3)
        print("v3:", report.results[0].status, report.results[0].error)
        assert report.ok, f"the next publish after the put-back ended failed: {report.results[0]}"
        assert engine.greedy("policy", PROMPT, 4)[0] == list(probe3.expected_ids), "the engine does not serve v3"
        engine.release.set()
        try:
            await task
        except BaseException:
            pass


asyncio.run(main())
