"""BUG (new with 41c3427): a publish whose content is unchanged (engines already serve it under the
previous version's name) and that COMPLETED -- report ok, lease(2) already answers policy@v1 -- is
cancelled while its aftercare (retirement, file collection) runs inline (Retention(background=False),
which every Fleet uses, or at interpreter exit). `_cancel_noted` sees no ledger holding v2 (an
"unchanged" publish is never recorded under v2: it is served under v1's name) and calls
`_note_unverified(2, cancelled=True)`, which also drops the `_served_as` entry: lease(2) now raises
VerificationError "was cancelled before any engine served it" although the engine serves v2's
exact weights under the name the ok report gave.

The cancel is timed by wrapping the publisher's `_note_served` (the moment the publish decided it
is ok) only to land it in the aftercare deterministically; a real-time cancel (wait_for) lands
there too, by chance.

Run: .venv/bin/python tests/reliability/repros/cancel_without_probe/unchanged_aftercare_cancel.py
"""
import asyncio, os, sys, tempfile, warnings
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../..")))
warnings.simplefilter("ignore")
from tests.reliability.repros.cancel_without_probe._helpers import same, served
from tests.reliability.test_cancel_without_probe import lora_state, step, trainer
from lorasync import Fleet, Publisher, Retention
from lorasync.engines.peft import PeftEngine
from lorasync.errors import VerificationError
from lorasync.exporters import fsdp
from lorasync.testing import make_tiny_model


async def cancel_once_served(pub, coro):
    ok = []
    orig = pub._note_served
    pub._note_served = lambda *a: (ok.append(a[1]), orig(*a))[1]
    task = asyncio.ensure_future(coro)
    while not ok and not task.done():
        await asyncio.sleep(0)
    task.cancel()
    try:
        await task
        return None, ok
    except asyncio.CancelledError:
        return "cancelled", ok


def check(label, pub_or_tenant, engine, v2, ok):
    try:
        with pub_or_tenant.lease(2) as name:
            s = served(engine, name)
            print(f"{label}: noted ok as {ok}; lease(2) -> {name!r}, serves v2 exactly: {same(s, v2)}")
            return None
    except VerificationError as exc:
        s = served(engine, ok[0]) if ok else None
        print(f"{label}: noted ok as {ok} (serving v2 exactly: {same(s, v2)}), then cancelled in the aftercare; lease(2) REFUSED: {exc}")
        return label


async def publisher_case(in_place):
    policy, optimizer = trainer()
    engine = PeftEngine(make_tiny_model(seed=0))
    kw = dict(transport="ipc", in_place=True) if in_place else dict(transport="disk")
    with tempfile.TemporaryDirectory() as root:
        async with Publisher([engine], name="policy", root=root, retention=Retention(keep=1, background=False), **kw) as pub:
            step(policy, optimizer, 1)
            assert (await pub.apublish(fsdp.export(policy, copy=True), version=1)).ok
            v2 = lora_state(policy)  # the trainer did not change the adapter: v2 == v1, "unchanged"
            out, ok = await cancel_once_served(pub, pub.apublish(fsdp.export(policy, copy=True), version=2))
            if out is None:
                print("finished before the cancel: nothing to check"); return None
            return check(f"Publisher(in_place={in_place})", pub, engine, v2, ok)


async def fleet_case():
    engine = PeftEngine(make_tiny_model(seed=0))
    policy, optimizer = trainer()
    step(policy, optimizer, 1)
    with tempfile.TemporaryDirectory() as root:
        async with Fleet([engine], root=root, transport="ipc") as fleet:
            tenant = fleet.register("t")
            assert (await fleet.apublish({"t": fsdp.export(policy, copy=True)}, versions={"t": 1})).ok
            v2 = lora_state(policy)
            out, ok = await cancel_once_served(tenant.publisher, fleet.apublish({"t": fsdp.export(policy, copy=True)}, versions={"t": 2}))
            if out is None:
                print("fleet round finished before the cancel"); return None
            return check("Fleet tenant (always background=False)", tenant, engine, v2, ok)


async def main():
    bad = [b for b in [await publisher_case(False), await publisher_case(True), await fleet_case()] if b]
    print("BUG in:", bad if bad else "none")
    sys.exit(1 if bad else 0)

asyncio.run(main())
