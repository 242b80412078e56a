"""BUG: an in-place swap a cancel left running past CANCELLED_CALL_WAIT_S lands later, and no
later publish ever learns it: the ledger still says the previous version serves, so a publish of
that previous content is reported ok / "unchanged" while the name serves the cancelled swap.

What the user sees: Publisher([engine], in_place=True, transport="ipc") on an in-process PEFT
engine that cannot say where each adapter was loaded from (adapter_sources() -> None, the
Engine default: SGLang tensor loads, vllm pull, any engine that does not override it; the PEFT
engine's per-load tokens are what lets check_memory() catch it otherwise). v1 (content C1) is published ok. publish(v2, content C2) is cancelled while the engine's
swap is stuck; the cancel returns after the bound (documented: the call is left running). The
swap then ends and "policy" serves C2. The trainer rolls back to the v1 checkpoint and publishes
it as v3: reconcile() waits for the (now finished) call, re-syncs the *versioned* listing only,
and leaves ledger.in_place = (v1, C1); _publish_one finds C1 "unchanged" and moves nothing.
report.ok is True, report.served_name == "policy", yet "policy" serves C2 (the cancelled
publish's weights). lease(3)/lease(1) also hand out "policy" serving C2.
Promise broken: "after a publish reports ok, every engine serves exactly those weights under
report.served_name"; and nothing a cancel left behind is noticed by the next publishes.

Run: .venv/bin/python tests/reliability/repros/cancel_without_probe/inplace_late_swap_reported_unchanged.py
"""
import asyncio
import sys

sys.path.insert(0, __import__("os").path.abspath(__import__("os").path.join(__import__("os").path.dirname(__file__), "../../../..")))
import lorasync.publisher._cancelled as _cancelled  # noqa: E402

_cancelled.CANCELLED_CALL_WAIT_S = 0.5

from tests.reliability.repros.cancel_without_probe._helpers import BusyPeftEngine, lora_state, same, served, step, trainer, until  # noqa: E402

from lorasync import Publisher  # noqa: E402
from lorasync.exporters import fsdp  # noqa: E402
from lorasync.testing import make_tiny_model  # noqa: E402


class NoSourcesEngine(BusyPeftEngine):
    def adapter_sources(self):  # the Engine default: "cannot tell"
        return None


async def main() -> None:
    policy, optimizer = trainer()
    engine = NoSourcesEngine(make_tiny_model(seed=0))
    async with Publisher([engine], name="policy", transport="ipc", in_place=True) as pub:
        step(policy, optimizer, 1)
        c1 = fsdp.export(policy, copy=True)
        w1 = lora_state(policy)
        assert (await pub.apublish(c1, version=1)).ok
        step(policy, optimizer, 2)
        w2 = lora_state(policy)
        engine.armed = True
        task = asyncio.ensure_future(pub.apublish(fsdp.export(policy, copy=True), version=2))
        await until(engine.entered.is_set)
        task.cancel()
        try:
            await asyncio.wait_for(task, 5)
        except asyncio.CancelledError:
            pass
        print("cancel returned after the bound; the swap still runs")
        engine.armed = False
        engine.go.set()  # the stuck swap ends now: it lands C2 under "policy"
        await until(lambda: same(served(engine, "policy"), w2))
        print("the left-running swap landed: 'policy' serves v2's (cancelled) weights")
        # the trainer rolls back to the v1 checkpoint and publishes it
        report = await pub.apublish(c1, version=3)
        await report.asettled()
        print("publish v3 (= v1's content):", report.ok, [r.status for r in report.results], "served_name", report.served_name)
        now = served(engine, "policy")
        print("'policy' serves v1/v3 content:", same(now, w1), "| serves cancelled v2:", same(now, w2))
        assert not report.ok or same(served(engine, report.served_name), w1), (
            "publish v3 reported ok but its served_name serves the cancelled v2 swap that landed late"
        )


asyncio.run(main())
