"""BUG: one engine's call ending in CancelledError (its own event loop dropped the call: an
AsyncLLM's loop shut down, so the run_coroutine_threadsafe future is cancelled) makes
apublish raise a bare asyncio.CancelledError to a caller that never cancelled anything. The
other engine's ok load is lost with it (no report, no aftercare), and the version is marked
"cancelled" for lease().

What the user sees: Publisher([A, B]); B's aload_adapter_tensors ends with CancelledError.
_guarded catches Exception only; gather_all gets the CancelledError in its results and re-raises
it; _apublish treats it as a cancel of the publish. `await pub.apublish(...)` raises
CancelledError (under asyncio.run the whole program ends "cancelled"), instead of a report with
A loaded and B failed with a typed lorasync error.
Promise broken: typed lorasync.errors errors; a failure on one engine never blocks the others.

Run: .venv/bin/python tests/reliability/repros/cancel_without_probe/engine_cancelled_future_untyped.py
"""
import asyncio
import concurrent.futures
import sys

sys.path.insert(0, __import__("os").path.abspath(__import__("os").path.join(__import__("os").path.dirname(__file__), "../../../..")))
from lorasync import Publisher  # noqa: E402
from lorasync.errors import LoraSyncError  # noqa: E402
from lorasync.exporters import fsdp  # noqa: E402
from lorasync.testing import MemoryEngine, make_peft_model, make_tiny_model  # noqa: E402


class LoopDroppedEngine(MemoryEngine):
    async def aload_adapter_tensors(self, name, adapter):
        dropped = concurrent.futures.Future()  # what run_coroutine_threadsafe returns when the engine's loop closed under the call
        dropped.cancel()
        await asyncio.wrap_future(dropped)


async def main() -> str:
    a, b = MemoryEngine(), LoopDroppedEngine()
    adapter = fsdp.export(make_peft_model(make_tiny_model(seed=0), seed=1), copy=True)
    async with Publisher([a, b], name="policy", transport="ipc") as pub:
        try:
            report = await pub.apublish(adapter, version=1)
        except asyncio.CancelledError:
            return f"apublish raised a bare CancelledError (nobody cancelled it); A lists {a.list_adapters()}"
        except LoraSyncError as exc:
            return f"ok: typed {type(exc).__name__}"
        return "ok: " + str([(r.status, type(r.error).__name__) for r in report.results])


outcome = asyncio.run(main())
print(outcome)
assert outcome.startswith("ok"), outcome
