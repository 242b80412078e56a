"""BUG (new with 41c3427 for a cancel before the engines' gather; the same refusal already
happened on b66259e for a cancel during the gather): v2 was published OK as "unchanged" (the
engine serves its exact bytes under policy@v1, or in place under policy; lease(2) -> that name).
The trainer publishes v2 again (a retry, handing the model so lorasync exports it) and that second
publish is cancelled while it exports, before touching any engine. `_cancel_noted` sees no ledger
holding v2 (an "unchanged" version is served under v1's name and never recorded as v2) and notes
v2 as cancelled: lease(2) now raises VerificationError "was cancelled before any engine served it",
although v2's last ok report stands and the engine still serves exactly v2's weights.
(A version that was *loaded* as v2 is not affected: its ledger holds it.)

Run: .venv/bin/python tests/reliability/repros/cancel_without_probe/unchanged_republish_cancel.py
"""
import asyncio, os, sys, tempfile, warnings
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../..")))
warnings.simplefilter("ignore")
from tests.reliability.repros.cancel_without_probe._helpers import same, served
from tests.reliability.test_cancel_without_probe import lora_state, step, trainer
from lorasync import Publisher
from lorasync.engines.peft import PeftEngine
from lorasync.errors import VerificationError
from lorasync.exporters import fsdp
from lorasync.testing import make_tiny_model


async def attempt(in_place):
    policy, optimizer = trainer()
    engine = PeftEngine(make_tiny_model(seed=0))
    kw = dict(transport="ipc", in_place=True) if in_place else dict(transport="disk")
    with tempfile.TemporaryDirectory() as root:
        async with Publisher([engine], name="policy", root=root, keep=1, **kw) as pub:
            step(policy, optimizer, 1)
            assert (await pub.apublish(fsdp.export(policy, copy=True), version=1)).ok
            v2 = lora_state(policy)  # no change since v1
            first = await pub.apublish(fsdp.export(policy, copy=True), version=2)
            assert first.ok, first
            with pub.lease(2) as before:
                pass
            task = asyncio.ensure_future(pub.apublish(policy, version=2))  # the same v2 again; exports in a thread first
            await asyncio.sleep(0)
            task.cancel()
            try:
                await task
                print(f"in_place={in_place}: the retry finished before the cancel; nothing to check")
                return None
            except asyncio.CancelledError:
                pass
            try:
                with pub.lease(2) as name:
                    print(f"in_place={in_place}: v2 ok ({[r.status for r in first.results]}, served_name={first.served_name!r}); retry cancelled; lease(2) -> {name!r}, serves v2: {same(served(engine, name), v2)}")
                    return None
            except VerificationError as exc:
                print(f"in_place={in_place}: v2 ok ({[r.status for r in first.results]}, served_name={first.served_name!r}, lease(2) was {before!r} serving v2: "
                      f"{same(served(engine, before), v2)}); retry cancelled while exporting; lease(2) REFUSED: {exc}")
                return f"in_place={in_place}"


async def main():
    bad = [b for b in [await attempt(False), await attempt(True)] if b]
    print("BUG in:", bad if bad else "none")
    sys.exit(1 if bad else 0)

asyncio.run(main())
