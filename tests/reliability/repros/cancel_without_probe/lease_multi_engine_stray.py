"""BUG: lease(v) hands out a versioned name that one engine serves with weights no publish
produced (the trainer's next step), because ANOTHER engine had recorded v before the cancel.

What the user sees: Publisher([A, B], transport="ipc") (versioned tensor loads, no probe).
publish(v2): engine A loads and records policy@v2; engine B's load is still running when the
publish is cancelled. A versioned load is not waited for (by design), so the load left running
on B reads the trainer's tensors AFTER the trainer stepped. The protection the docs promise is
that `lease()` refuses such a version -- but `_apublish` calls
`_note_unverified(version, cancelled=True)` only `if not recorded()`, and `recorded()` is true
as soon as ANY engine's ledger holds v2. So `pub.lease(2)` yields "policy@v2", and requests sent
to engine B under that name run on step-3 weights.

Promise broken: "never weights no publish produced under a name a user is given (report,
lease)" (docs/concepts.md: "lease() refuses a version whose publish was cancelled before any
engine recorded it" only covers the single-engine case; the multi-engine case serves junk).

Run: .venv/bin/python tests/reliability/repros/cancel_without_probe/lease_multi_engine_stray.py
"""
import asyncio
import sys

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from _helpers import BusyPeftEngine, lora_state, same, served, step, trainer, until  # noqa: E402

from lorasync import Publisher  # noqa: E402
from lorasync.errors import VerificationError  # noqa: E402
from lorasync.exporters import fsdp  # noqa: E402
from lorasync.testing import make_tiny_model  # noqa: E402


async def main() -> None:
    policy, optimizer = trainer()
    a = BusyPeftEngine(make_tiny_model(seed=0))
    b = BusyPeftEngine(make_tiny_model(seed=0))
    async with Publisher([a, b], name="policy", transport="ipc") as pub:
        step(policy, optimizer, 1)
        assert (await pub.apublish(fsdp.export(policy), version=1)).ok
        step(policy, optimizer, 2)
        v2 = lora_state(policy)
        b.armed = True
        task = asyncio.ensure_future(pub.apublish(fsdp.export(policy), version=2))
        await until(lambda: b.entered.is_set() and "policy@v2" in a.list_adapters())
        await asyncio.sleep(0.1)  # A recorded v2
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        step(policy, optimizer, 3)  # the trainer goes on once the cancel returned
        b.armed = False
        b.go.set()
        await until(lambda: "policy@v2" in b.list_adapters())
        await asyncio.sleep(0.2)
        try:
            with pub.lease(2) as model:
                print("lease(2) ->", model)
                on_a, on_b = served(a, model), served(b, model)
                print("engine A serves v2 exactly:", same(on_a, v2), "| engine B serves v2 exactly:", same(on_b, v2))
                assert same(on_b, v2), f"leased {model!r}: engine B serves weights no publish produced under it"
        except VerificationError as exc:
            print("lease refused:", exc)


asyncio.run(main())
