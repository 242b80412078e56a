"""BUG: in place, a publish with a probe that is cancelled is taken out (v1 put back), yet
lease(2) is accepted and yields "policy" -- which serves v1, not v2.

What the user sees: Publisher([engine], transport="ipc", in_place=True, verify=probe).
publish(v2) is cancelled during the swap; the cancel waits, then `withdraw_cancelled` puts v1
back (documented: "a version with a probe is taken out again (unverified)"). Nothing recorded
v2. But `_apublish`'s `recorded()` lambda is `self.in_place or ...` -- always True in place --
so `_note_unverified(2, cancelled=True)` never runs, and `pub.lease(2)` hands out "policy" for
a version no engine serves (the same publish failing its probe instead IS refused by lease).

Promise broken: docs/concepts.md "lease() refuses a version whose publish was cancelled before
any engine recorded it"; "never a stale or wrong adapter under a name a user is given (lease)":
rollouts tagged as step 2 run on step-1 weights.

Run: .venv/bin/python tests/reliability/repros/cancel_without_probe/in_place_probe_cancel_lease.py
"""
import asyncio
import sys

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from _helpers import PROMPT, BusyPeftEngine, lora_state, same, served, step, trainer, until  # noqa: E402

from lorasync import Probe, Publisher  # noqa: E402
from lorasync.errors import VerificationError  # noqa: E402
from lorasync.exporters import fsdp  # noqa: E402
from lorasync.testing import make_tiny_model  # noqa: E402


async def main() -> None:
    policy, optimizer = trainer()
    engine = BusyPeftEngine(make_tiny_model(seed=0))
    async with Publisher([engine], name="policy", transport="ipc", in_place=True) as pub:
        step(policy, optimizer, 1)
        v1 = lora_state(policy)
        assert (await pub.apublish(fsdp.export(policy), version=1, verify=Probe.from_model(policy, PROMPT, max_tokens=4))).ok
        step(policy, optimizer, 2)
        v2 = lora_state(policy)
        probe2 = Probe.from_model(policy, PROMPT, max_tokens=4)
        engine.armed = True
        task = asyncio.ensure_future(pub.apublish(fsdp.export(policy), version=2, verify=probe2))
        await until(engine.entered.is_set)
        task.cancel()
        await asyncio.sleep(0.1)
        engine.armed = False
        engine.go.set()
        try:
            await task
        except asyncio.CancelledError:
            pass
        now = served(engine, "policy")
        print("engine serves v1:", same(now, v1), "| serves v2:", same(now, v2))
        assert same(now, v1)  # taken out, v1 put back: documented
        try:
            with pub.lease(2) as model:
                print("lease(2) ->", model, "| what it serves is v2:", same(served(engine, model), v2))
                assert same(served(engine, model), v2), "lease(2) yields a name serving v1 (v2 was taken out)"
        except VerificationError as exc:
            print("lease(2) refused (expected):", exc)


asyncio.run(main())
