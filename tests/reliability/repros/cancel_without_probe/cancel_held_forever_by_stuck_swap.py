"""BUG: a cancel of a publish whose engine call never returns is held for ever, and with it the
next publish and close(); before 8056e48 the same cancel (two engines, one stuck) returned.

What the user sees: Publisher([A, B], in_place=True, transport="ipc"), two in-process PEFT
engines. publish(v2) is cancelled while engine B's swap hangs (a generation holding the engine,
a wedged worker). gather_all waits for every engine's part, and B's part waits in finish() for
the swap without any bound, holding the publisher's lock. So:
  * task.cancel() never takes effect: the awaiting code is stuck (an asyncio.run Ctrl-C too);
  * the next apublish(v3) waits for the lock for ever, although docs/concepts.md promises "A
    cancelled publish does not hold the next one ... The next publish to that engine waits for
    that call 5 s at most (CANCELLED_CALL_WAIT_S) ... reported failed with EngineTimeoutError";
  * aclose() waits for the same lock for ever.
Promise broken: "no call hangs" (every call ends in a result or a typed error).

Run: .venv/bin/python tests/reliability/repros/cancel_without_probe/cancel_held_forever_by_stuck_swap.py
"""
import asyncio
import sys

sys.path.insert(0, __import__("os").path.abspath(__import__("os").path.join(__import__("os").path.dirname(__file__), "../../../..")))
from tests.reliability.test_cancel_without_probe import BusyPeftEngine, step, trainer  # noqa: E402

from lorasync import Publisher  # noqa: E402
from lorasync.exporters import fsdp  # noqa: E402
from lorasync.publisher._cancelled import CANCELLED_CALL_WAIT_S  # noqa: E402
from lorasync.testing import make_tiny_model  # noqa: E402

BOUND = CANCELLED_CALL_WAIT_S + 10.0  # slack for a loaded CI box: the bug held them for ever


class StuckPeftEngine(BusyPeftEngine):
    def _busy(self) -> None:  # armed: the swap hangs (until the script lets it go at the end)
        if self.armed:
            self.entered.set()
            self.go.wait(600)


async def main() -> None:
    policy, optimizer = trainer()
    a, b = BusyPeftEngine(make_tiny_model(seed=0)), StuckPeftEngine(make_tiny_model(seed=0))
    pub = Publisher([a, b], name="policy", transport="ipc", in_place=True)
    step(policy, optimizer, 1)
    assert (await pub.apublish(fsdp.export(policy, copy=True), version=1)).ok
    step(policy, optimizer, 2)
    b.armed = True
    task = asyncio.ensure_future(pub.apublish(fsdp.export(policy, copy=True), version=2))
    while not b.entered.is_set():
        await asyncio.sleep(0.01)
    task.cancel()
    b.armed = False
    step(policy, optimizer, 3)
    nxt = asyncio.ensure_future(pub.apublish(fsdp.export(policy, copy=True), version=3))
    done, _ = await asyncio.wait([task, nxt], timeout=BOUND)
    print(f"after {BOUND:g} s: cancel returned: {task in done} | next publish returned: {nxt in done}")
    closing = asyncio.ensure_future(pub.aclose())
    await asyncio.wait([closing], timeout=10.0)
    print("aclose() returned within 10 s:", closing.done())
    ok = task.done() and nxt.done() and closing.done()
    b.go.set()  # let the stuck swap end so the script can clean up
    await asyncio.gather(task, nxt, closing, return_exceptions=True)
    assert ok, "the cancel, the next publish and/or aclose() were held by an engine call that never returned"


asyncio.run(main())
