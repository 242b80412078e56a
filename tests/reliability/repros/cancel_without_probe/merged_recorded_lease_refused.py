"""BUG: for a merged publisher, a cancelled merge that LANDED and was RECORDED (kept, exact) is
still refused by lease() as "cancelled before any engine served it".

What the user sees: Publisher([engine], transport="merged"). publish(v2) is cancelled while the
engine closes its weight-update gate; per the docs the cancel waits, the merge is exact, so it
is kept and recorded (ledger.merged = v2) -- the engine serves v2. Yet `pub.lease(2)` raises
VerificationError "pol v2 was cancelled before any engine served it". Cause: `_apublish`'s
`recorded = lambda: self.in_place or any(version in ledger.versions ...)` never looks at
`ledger.merged` (merges are never in ledger.versions), so every cancelled merge publish calls
`_note_unverified(version, cancelled=True)`.

Promise broken: docs/concepts.md -- a landed exact merge "is kept and recorded, like any load";
lease() refuses only "a version whose publish was cancelled before any engine recorded it". The
typed error tells the user something false (the version IS served).

Run: .venv/bin/python tests/reliability/repros/cancel_without_probe/merged_recorded_lease_refused.py
"""
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from _helpers import GatedEngine, same, until  # noqa: E402

from lorasync import Publisher  # noqa: E402
from lorasync.errors import VerificationError  # noqa: E402
from lorasync.exporters import fsdp  # noqa: E402
from lorasync.testing import make_peft_model, make_tiny_model  # noqa: E402


async def main(tmp: Path) -> None:
    base_dir = tmp / "base"
    make_tiny_model(base_dir)
    v1 = fsdp.export(make_peft_model(make_tiny_model(seed=0), seed=1), copy=True)
    v2 = fsdp.export(make_peft_model(make_tiny_model(seed=0), seed=2), copy=True)
    engine = GatedEngine()
    async with Publisher([engine], name="pol", transport="merged", base=base_dir, root=tmp / "store") as pub:
        assert (await pub.apublish(v1, version=1)).ok
        w1 = {k: v.clone() for k, v in engine.weights.items()}
        engine.armed = True
        task = asyncio.ensure_future(pub.apublish(v2, version=2))
        await until(engine.entered.is_set)
        task.cancel()
        await asyncio.sleep(0.1)
        engine.armed = False
        engine.go.set()
        try:
            await task
        except asyncio.CancelledError:
            pass
        ledger = next(iter(pub._ledgers.values()))
        print("engine serves the v2 merge:", not same(dict(engine.weights), w1), "| ledger.merged version:", ledger.merged and ledger.merged[0])
        assert ledger.merged is not None and ledger.merged[0] == 2  # recorded, as documented
        try:
            with pub.lease(2):
                print("lease(2) accepted")
        except VerificationError as exc:
            print("lease(2) refused:", exc)
            raise AssertionError("lease refuses a merged version that landed and was recorded") from exc


with tempfile.TemporaryDirectory() as d:
    asyncio.run(main(Path(d)))
