"""BUG: a merge a cancel left running past CANCELLED_CALL_WAIT_S completes later (the cancel only
stops waiting: to_the_end() shields the delivery, so it is never even cancelled), and the
publisher goes on believing the previous merge serves. A later publish of the previous content
is reported ok / "unchanged" while the engine serves the cancelled publish's merge.

What the user sees: Publisher([engine], transport="merged", base=...) on an in-process
MemoryEngine(weight_update=True) whose gate (end_weight_update) is slow once. v1 is merged ok.
publish(v2) is cancelled while the engine closes the gate; after the bound the cancel returns
(documented: the call is left to the next publish). The gate closes, the merge of v2 is complete
and serves. ledger.merged still says (v1, C1), and check_memory() keeps it because
MergedTransport.serves(engine) is True (v2's merge was made by the same transport). Publishing v1's
adapter again as v3 (a roll-back) reports ok with status "unchanged" and moves nothing: the engine
serves v2's merge. Before 2f0683a the cancel waited and keep_cancelled() recorded the v2 merge
(tests/reliability: test_a_merge_cancelled_as_it_closes_the_gate_is_recorded_not_forgotten).
Promise broken: "after a publish reports ok, every engine serves exactly those weights".

Run: .venv/bin/python tests/reliability/repros/cancel_without_probe/merged_late_merge_reported_unchanged.py
"""
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, __import__("os").path.abspath(__import__("os").path.join(__import__("os").path.dirname(__file__), "../../../..")))
import lorasync.publisher._cancelled as _cancelled  # noqa: E402

_cancelled.CANCELLED_CALL_WAIT_S = 0.5

from tests.reliability.repros.cancel_without_probe._helpers import GatedEngine, same, until  # noqa: E402

from lorasync import Publisher  # noqa: E402
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
        try:
            await asyncio.wait_for(task, 5)
        except asyncio.CancelledError:
            pass
        print("cancel returned after the bound; the merge's gate is still closing")
        engine.armed = False
        engine.go.set()
        await until(lambda: not same(dict(engine.weights), w1))
        await asyncio.sleep(0.2)
        print("v2's merge now serves:", not same(dict(engine.weights), w1))
        report = await pub.apublish(v1, version=3)  # roll back to v1's adapter
        await report.asettled()
        print("publish v3 (= v1's adapter):", report.ok, [r.status for r in report.results])
        ok_serves = same(dict(engine.weights), w1)
        print("engine serves v1/v3's merge:", ok_serves)
        assert not report.ok or ok_serves, "publish v3 reported ok but the engine serves the cancelled v2 merge"


with tempfile.TemporaryDirectory() as d:
    asyncio.run(main(Path(d)))
