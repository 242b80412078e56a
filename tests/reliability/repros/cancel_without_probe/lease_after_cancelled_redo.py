"""BUG: a publish cancelled during its second round ("again": an engine that answered "unchanged"
loads the content once more under the new name) is never refused by lease(), although one engine
never recorded the version and serves, under that very name, weights no publish produced.

What the user sees: Publisher([A, B], transport="ipc"), in-process PEFT engines, no probe, the
trainer's own tensors (fsdp.export, no copy). v1 fails on B only. The trainer publishes the same
content again as v2: A answers "unchanged" (it serves it as policy@v1), B loads policy@v2, so
_apublish loads it on A too as policy@v2 through a second gather_all -- which is outside the
`except asyncio.CancelledError` that notes the version for lease() to refuse. The publish is
cancelled while A's load of policy@v2 runs; the cancel returns at once (a versioned load is not
waited for), the trainer steps, A's load lands with the stepped tensors. `pub.lease(2)` then
hands out "policy@v2" -- a name no report gave -- and A serves the trainer's next step under it.
Promise broken: never weights no publish produced under a name the user is given (lease());
docs/concepts.md "lease() refuses a version whose publish was cancelled before every engine
recorded it".

Run: .venv/bin/python tests/reliability/repros/cancel_without_probe/lease_after_cancelled_redo.py
"""
import asyncio
import sys

sys.path.insert(0, __import__("os").path.abspath(__import__("os").path.join(__import__("os").path.dirname(__file__), "../../../..")))
from tests.reliability.test_cancel_without_probe import BusyPeftEngine, lora_state, step, trainer  # noqa: E402
from tests.reliability.repros.cancel_without_probe._helpers import same, served  # noqa: E402

from lorasync import Publisher  # noqa: E402
from lorasync.errors import EngineUnavailableError, VerificationError  # noqa: E402
from lorasync.exporters import fsdp  # noqa: E402
from lorasync.testing import make_tiny_model  # noqa: E402


class FlakyPeftEngine(BusyPeftEngine):
    fail_once = False

    def load_adapter_tensors(self, name, adapter):
        if self.fail_once:
            self.fail_once = False
            raise EngineUnavailableError("connection reset (once)")
        return super().load_adapter_tensors(name, adapter)


async def main() -> None:
    policy, optimizer = trainer()
    a, b = BusyPeftEngine(make_tiny_model(seed=0)), FlakyPeftEngine(make_tiny_model(seed=0))
    async with Publisher([a, b], name="policy", transport="ipc") as pub:
        step(policy, optimizer, 1)
        b.fail_once = True
        r1 = await pub.apublish(fsdp.export(policy), version=1)
        print("v1:", [r.status for r in r1.results])
        a.armed = True  # A's only load of v2 is the second round's
        task = asyncio.ensure_future(pub.apublish(fsdp.export(policy), version=2))  # same content, retried
        while not a.entered.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        print("B serves policy@v2:", "policy@v2" in b.list_adapters())
        step(policy, optimizer, 2)  # the trainer goes on once the cancel returned
        unpublished = lora_state(policy)
        a.armed = False
        a.go.set()
        await asyncio.sleep(0.5)  # A's load left running lands, with what it reads now
        try:
            with pub.lease(2) as name:
                on_a = served(a, name)
                print(f"lease(2) -> {name!r}; A serves the trainer's unpublished next step under it: {same(on_a, unpublished)}")
                assert False, f"lease(2) handed out {name!r} after a cancelled publish that A never recorded"
        except VerificationError as exc:
            print("lease(2) refused:", exc)


asyncio.run(main())
