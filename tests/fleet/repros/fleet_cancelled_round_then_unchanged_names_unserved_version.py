"""A Fleet round cancelled (asyncio.wait_for timeout) just after the engine loaded the new version
leaves the engine serving it while the tenant stays on the previous version; the next round with
the same weights then reports the tenant "unchanged" under a served name no engine serves, and
every round after that fails until the weights change.

Mechanism: the cancel lands in Publisher._apublish at `await asyncio.gather(...)` after the
engine's publish finished (handle.delivered recorded vN in the publisher's ledger) but before
_note_served (which moves the tenant). The next round hashes the same weights: != the tenant's
recorded hash -> "changed", publish vN+1; the publisher's ledger says the engine serves identical
content as vN -> status "unchanged", served name name@vN. Fleet's step() then moves the tenant to
vN+1 anyway (it only compares the version and hash with the tenant's), so the report and
tenant.lease() name name@vN+1, which is not loaded anywhere, and vN+1's files were discarded: the
following rounds find it "lost" and fail to restore it (StorageError). Same root cause as
fleet_files_aba_unchanged_names_unserved_version.py (step() trusts a publish that reports
unchanged under an older name), another trigger; it happens with transport "disk" and "auto".

The cancel window is one event-loop turn, so the script sweeps the timeout over a range, one
cancelled round per try, and stops at the first hit (seen within 4-10 tries here).

Run: python tests/fleet/repros/fleet_cancelled_round_then_unchanged_names_unserved_version.py
Exits 1 when the bug shows.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from lorasync import Fleet
from lorasync.engines.peft import PeftEngine
from lorasync.exporters.fsdp import export
from lorasync.testing import make_tiny_model
from tests.reliability._trust import step, trainer

TRIES = 800
root = Path(tempfile.mkdtemp())
make_tiny_model(root / "m")
model = trainer(root / "m", seed=1)
engine = PeftEngine(base_model_path=root / "m")


async def main() -> str | None:
    async with Fleet([engine], root=root / "store", transport="disk") as fleet:
        await fleet.aregister("a", keep=2, grace=0.0)
        version = 1
        await fleet.apublish({"a": export(model)}, versions={"a": version})
        # A full round's duration: the cancels are spread over it.
        step(model, seed=1)
        version += 1
        start = time.perf_counter()
        await fleet.apublish({"a": export(model)}, versions={"a": version})
        full = time.perf_counter() - start
        for i in range(TRIES):
            step(model, seed=i + 10)  # the trainer stepped: a new version to publish
            version += 1
            try:
                await asyncio.wait_for(fleet.apublish({"a": export(model)}, versions={"a": version}), timeout=full * 1.5 * ((i * 37) % 100) / 100)
            except asyncio.TimeoutError:
                pass  # the caller gave up on this round; it publishes again below
            version += 1
            report = (await fleet.apublish({"a": export(model)}, versions={"a": version}))["a"]
            listed = engine.list_adapters()
            if report.ok and report.served_name not in listed:
                later = (await fleet.apublish({"a": export(model)}, versions={"a": version + 1}))["a"]
                return (
                    f"try {i}: after a cancelled round, the next round reports {report.status!r} with served_name "
                    f"{report.served_name!r} (tenant.version {fleet.tenants['a'].version}); the engine lists {listed}. "
                    f"The round after that (same weights): {later.status} {later.error!r}"[:600]
                )
        return None


bug = asyncio.run(main())
engine.close()
print("BUG:", bug if bug else "none seen")
sys.exit(1 if bug else 0)
