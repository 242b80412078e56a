"""BUG: with two engines, a cancelled in-place publish returns before the second engine's swap
ended, and that swap later clobbers the NEXT publish, which had reported ok.

What the user sees: Publisher([A, B], in_place=True, transport="ipc"). publish(v2) is cancelled
while both engines swap. `finish()` is meant to hold the cancel until every in-place swap
ended (docs/concepts.md "A cancel waits for a delivery ..."). But `_apublish` awaits
`asyncio.gather(*children)` without return_exceptions: as soon as ONE child (engine A) finishes
its swap and re-raises CancelledError, gather sets its exception and the cancel reaches the
caller while engine B's child is still inside `finish(delivering)`. The publisher's lock is
released too. The trainer steps, publishes v3: report.ok on both engines. Then B's orphaned v2
child resumes: keep_cancelled sees torn tensors and "takes v2 out" by putting back `previous`
(the v1 entry captured before v3 existed) or unloading -- engine B no longer serves v3.

Promises broken: "a cancel waits for an in-place swap" (the trainer stepped under a running
swap), and "after a publish reports ok, the engine serves exactly those weights under
report.served_name" (B serves nothing / not v3 after v3's ok report).

Run: .venv/bin/python tests/reliability/repros/cancel_without_probe/gather_two_engines_in_place.py
"""
import asyncio
import sys

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from _helpers import BusyPeftEngine, lora_state, same, served, step, trainer, until  # noqa: E402

from lorasync import Publisher  # noqa: E402
from lorasync.exporters import fsdp  # noqa: E402
from lorasync.testing import make_tiny_model  # noqa: E402


async def main() -> None:
    policy, optimizer = trainer()
    a = BusyPeftEngine(make_tiny_model(seed=0))
    b = BusyPeftEngine(make_tiny_model(seed=0))
    async with Publisher([a, b], name="policy", transport="ipc", in_place=True) as pub:
        step(policy, optimizer, 1)
        assert (await pub.apublish(fsdp.export(policy), version=1)).ok
        step(policy, optimizer, 2)
        a.armed = b.armed = True
        task = asyncio.ensure_future(pub.apublish(fsdp.export(policy), version=2))
        await until(lambda: a.entered.is_set() and b.entered.is_set())
        task.cancel()
        await asyncio.sleep(0.1)
        a.armed = False
        a.go.set()  # engine A's swap ends; engine B's is still running
        try:
            await asyncio.wait_for(asyncio.shield(task), 2.0)
        except asyncio.CancelledError:
            pass
        except asyncio.TimeoutError:
            pass
        cancel_returned_early = task.done()
        print("cancel returned while engine B still swaps:", cancel_returned_early)

        # The trainer goes on as soon as the cancel returned, and publishes its next step.
        b.armed = False  # B's next calls are not held (its v2 swap thread still waits on go)
        step(policy, optimizer, 3)
        v3 = lora_state(policy)
        if cancel_returned_early:
            report = await pub.apublish(fsdp.export(policy, copy=True), version=3)
            print("v3 report ok:", report.ok, [r.status for r in report.results])
            assert report.ok
            assert same(served(b, "policy"), v3), "B serves v3 right after the ok report"
        b.go.set()  # B's swap of the cancelled v2 finally runs
        await asyncio.sleep(1.0)
        if not cancel_returned_early:
            await task if not task.done() else None
        now_b = served(b, "policy")
        print("after v3 ok: A serves v3:", same(served(a, "policy"), v3), "| B serves v3:", same(now_b, v3), "| B serves anything:", now_b is not None)
        assert not cancel_returned_early, "the cancel returned before engine B's in-place swap ended"


asyncio.run(main())
