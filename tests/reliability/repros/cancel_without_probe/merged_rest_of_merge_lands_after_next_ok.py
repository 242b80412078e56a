"""BUG: a merge a cancel left running past CANCELLED_CALL_WAIT_S keeps starting engine calls
(the next buckets, the end of the update) that the next publish never waits for: the cancel noted
only the calls in flight at that moment (CancelledCalls.watch copies `[c for c in calls if not
c.done()]`), so the next publish's reconcile() finds "nothing running" as soon as that one call
ends, and merges its own version while the cancelled merge is still being pushed. The cancelled
merge's buckets then land AFTER the next publish reported ok: the engine serves the cancelled
publish's weights (here: in full; with several buckets, a mix of both) under the base model.

What the user sees: Publisher([engine], transport="merged") on an in-process MemoryEngine whose
begin_weight_update waits for requests to drain and whose update is slow (a loaded engine).
publish(v2) is cancelled while the engine drains; after the bound the cancel returns (documented:
the call is left to the next publish). The drain ends; v2's merge goes on pushing. publish(v3)
runs at once, reports ok ("loaded"), and a moment later v2's bucket lands: the engine no longer
serves v3. Nothing notices: ledger.merged says v3; a later publish of v3's content is
"unchanged".
Promise broken: "after a publish reports ok, every engine serves exactly those weights"; the
next publish must wait (bounded) for what a cancel left running (docs/concepts.md).

Run: .venv/bin/python tests/reliability/repros/cancel_without_probe/merged_rest_of_merge_lands_after_next_ok.py
"""
import asyncio
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, __import__("os").path.abspath(__import__("os").path.join(__import__("os").path.dirname(__file__), "../../../..")))
import lorasync.publisher._cancelled as _cancelled  # noqa: E402

_cancelled.CANCELLED_CALL_WAIT_S = 0.5

from tests.reliability.repros.cancel_without_probe._helpers import same, until  # noqa: E402

from lorasync import Publisher  # noqa: E402
from lorasync.exporters import fsdp  # noqa: E402
from lorasync.testing import MemoryEngine, make_peft_model, make_tiny_model  # noqa: E402


class DrainingEngine(MemoryEngine):
    """Once armed: begin_weight_update waits for requests to drain, then the next bucket is slow."""

    def __init__(self) -> None:
        super().__init__(weight_update=True, tensor_load=False)
        self.armed = False
        self.draining, self.drained = threading.Event(), threading.Event()
        self.pushing, self.pushed = threading.Event(), threading.Event()
        self._slow_next = False

    def begin_weight_update(self) -> None:
        if self.armed:
            self.armed = False
            self.draining.set()
            self.drained.wait(30)
            self._slow_next = True

    def update_weights(self, named_tensors):
        if self._slow_next:
            self._slow_next = False
            self.pushing.set()
            self.pushed.wait(30)
        super().update_weights(named_tensors)


async def main(tmp: Path) -> None:
    base_dir = tmp / "base"
    make_tiny_model(base_dir)
    adapters = {v: fsdp.export(make_peft_model(make_tiny_model(seed=0), seed=v), copy=True) for v in (1, 2, 3)}
    engine = DrainingEngine()
    async with Publisher([engine], name="pol", transport="merged", base=base_dir, root=tmp / "store") as pub:
        assert (await pub.apublish(adapters[1], version=1)).ok
        engine.armed = True
        task = asyncio.ensure_future(pub.apublish(adapters[2], version=2))
        await until(engine.draining.is_set)
        task.cancel()
        try:
            await asyncio.wait_for(task, 5)
        except asyncio.CancelledError:
            pass
        print("cancel of v2 returned after the bound; the engine is still draining")
        engine.drained.set()  # the drain ends: v2's merge goes on, pushing its bucket
        await until(engine.pushing.is_set)
        report = await asyncio.wait_for(pub.apublish(adapters[3], version=3), 10)
        print("publish v3:", report.ok, [(r.status, type(r.error).__name__ if r.error else None) for r in report.results])
        w3 = {k: v.clone() for k, v in engine.weights.items()}
        engine.pushed.set()  # v2's bucket, started after the cancel returned, lands now
        await asyncio.sleep(0.5)
        still = same(dict(engine.weights), w3)
        print("after v3's ok report, the engine still serves v3's merge:", still)
        assert not report.ok or still, "v3 reported ok, then the cancelled v2 merge's bucket landed over it"


with tempfile.TemporaryDirectory() as d:
    asyncio.run(main(Path(d)))
