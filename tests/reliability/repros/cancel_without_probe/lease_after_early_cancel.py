"""BUG (outside attack of 2026-12-07, fourth pass of the 11:55 session): a publish cancelled after
it began but before any engine was touched (waiting for the previous publish's retirement or the
publisher's lock, or exporting the model it was handed) left ``lease(version)`` handing out a name
that does not serve that version: ``policy@v2``, which no engine lists (requests 404), or, in
place, ``policy``, which serves v1's weights, so rollouts attributed to v2 ran on v1.

Promise: lease() names what serves the version, and refuses a version whose publish was cancelled
before every engine recorded it (docs/concepts.md). Exits 0 once every such lease refuses (typed)
or names what serves v2.

Run: .venv/bin/python tests/reliability/repros/cancel_without_probe/lease_after_early_cancel.py
"""
import asyncio
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../..")))
from tests.reliability.repros.cancel_without_probe._helpers import same, served  # noqa: E402
from tests.reliability.test_cancel_without_probe import lora_state, step, trainer  # noqa: E402

from lorasync import Publisher  # noqa: E402
from lorasync.engines.peft import PeftEngine  # noqa: E402
from lorasync.errors import VerificationError  # noqa: E402
from lorasync.exporters import fsdp  # noqa: E402
from lorasync.testing import make_tiny_model  # noqa: E402


async def attempt(in_place: bool, *, hand_the_model: bool) -> str | None:
    policy, optimizer = trainer()
    engine = PeftEngine(make_tiny_model(seed=0))
    kw = dict(transport="ipc", in_place=True) if in_place else dict(transport="disk")
    async with Publisher([engine], name="policy", keep=1, **kw) as pub:
        step(policy, optimizer, 1)
        v1 = lora_state(policy)
        assert (await pub.apublish(fsdp.export(policy, copy=True), version=1)).ok
        step(policy, optimizer, 2)
        v2 = lora_state(policy)
        # Handed the model, the publish exports it in a thread first: a cancel lands there, before
        # any engine; handed an Adapter, it lands wherever the publish first waits.
        task = asyncio.ensure_future(pub.apublish(policy if hand_the_model else fsdp.export(policy, copy=True), version=2))
        await asyncio.sleep(0)
        task.cancel()
        try:
            await task
            return None  # it finished before the cancel: nothing to check
        except asyncio.CancelledError:
            pass
        try:
            with pub.lease(2) as name:
                s = served(engine, name)
                if s is not None and same(s, v2):
                    return None
                what = "nothing" if s is None else ("v1's weights" if same(s, v1) else "other weights")
                return f"in_place={in_place}, model={hand_the_model}: lease(2) -> {name!r}, which serves {what}"
        except VerificationError:
            print(f"in_place={in_place}, model={hand_the_model}: lease(2) refused, typed")
            return None


async def main() -> None:
    bad = [r for in_place in (False, True) for model in (True, False) if (r := await attempt(in_place, hand_the_model=model))]
    assert not bad, bad


asyncio.run(main())
print("OK")
