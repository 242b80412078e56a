"""BUG: a Fleet round whose *restore* of a tenant's current version is cancelled makes
`tenant.lease()` refuse that current version for good (until the tenant steps), although the
engine serves exactly it and an earlier publish of it reported ok.

What the user sees: Fleet([engine], transport="ipc"), tenant "t" published v1 (ok). The engine
loses t@v1 (restart). The next round restores it (`republish` -> `Publisher._apublish(v1,
restore=True)`); the round is cancelled while the load runs. `_apublish` sees no ledger holding
v1 (the restore re-synced the ledger) and calls `_note_unverified(1, cancelled=True)`. The load
lands (from the tenant's owned copy: exact v1). From then on `with tenant.lease() as model:`
raises VerificationError "t v1 was cancelled before any engine served it" -- and later rounds
never clear it: the engine lists t@v1 again, so the tenant is not "lost", nothing republishes
v1, and `_note_served(1)` never runs.

Promise broken: a version whose publish reported ok stays leasable while served; the refusal
is for "a version whose publish was cancelled before any engine recorded it" -- v1 was recorded
and reported ok long before; a cancelled restore must lose nothing ("a cancelled publish loses
nothing, the next publish works"). Rollouts of an idle tenant can no longer lease its model.

Run: .venv/bin/python tests/reliability/repros/cancel_without_probe/fleet_cancelled_restore_lease.py
"""
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from _helpers import BusyPeftEngine, lora_state, same, served, until  # noqa: E402

from lorasync import Fleet  # noqa: E402
from lorasync.errors import VerificationError  # noqa: E402
from lorasync.exporters import fsdp  # noqa: E402
from lorasync.testing import make_peft_model, make_tiny_model  # noqa: E402


async def main(tmp: Path) -> None:
    engine = BusyPeftEngine(make_tiny_model(seed=0))
    model = make_peft_model(make_tiny_model(seed=0), seed=5)
    v1 = lora_state(model)
    async with Fleet([engine], root=tmp, transport="ipc") as fleet:
        tenant = fleet.register("t")
        report = await fleet.apublish({"t": fsdp.export(model, copy=True)}, versions={"t": 1})
        assert report.ok and tenant.version == 1
        with tenant.lease() as name:
            assert name == "t@v1"
        engine.unload_adapter("t@v1")  # the engine lost it (restarted)
        engine.armed = True
        round_ = asyncio.ensure_future(fleet.apublish({}, versions={}))  # restores t@v1
        await until(engine.entered.is_set)
        round_.cancel()
        try:
            await round_
        except asyncio.CancelledError:
            pass
        engine.armed = False
        engine.go.set()
        await until(lambda: "t@v1" in engine.list_adapters())
        await asyncio.sleep(0.2)
        print("engine serves t@v1 exactly:", same(served(engine, "t@v1"), v1))
        report = await fleet.apublish({}, versions={})  # a later round: nothing is lost, nothing republished
        print("later round ok:", report.ok, "| tenant.version:", tenant.version)
        try:
            with tenant.lease() as name:
                print("tenant.lease() ->", name)
        except VerificationError as exc:
            print("tenant.lease() refused:", exc)
            raise AssertionError("the tenant's current, served version cannot be leased after a cancelled restore") from exc


with tempfile.TemporaryDirectory() as d:
    asyncio.run(main(Path(d)))
