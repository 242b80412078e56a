"""Fleet: a round cancelled mid-write of tenant 'a' v2 (slow disk), then fleet.retire('a') while the
abandoned write still runs, then the write ends. Checks: nothing of 'a' left under the root,
no run of 'a' still LIVE, re-register + publish works, close is prompt."""
import asyncio, os, sys, tempfile, threading, time
from pathlib import Path
from lorasync import Fleet
from lorasync.adapter._adapter import Adapter
from lorasync.testing import MemoryEngine, tiny_llama_adapter
from lorasync.transports._owned import LIVE

root = Path(os.environ["REPRO_ROOT"])
engine = MemoryEngine()
fleet = Fleet([engine], transport="disk", root=root)
started, release, ended = threading.Event(), threading.Event(), threading.Event()
HOLD = float(os.environ.get("HOLD", "1.0"))

class Held(Adapter):
    def save_hashed(self, *args, **kw):
        started.set(); release.wait(30)
        try: return super().save_hashed(*args, **kw)
        finally: threading.Timer(0.3, ended.set).start()

async def main():
    await fleet.aregister("a", grace=0.0)
    await fleet.apublish({"a": tiny_llama_adapter(seed=1)}, versions={"a": 1})
    a2 = tiny_llama_adapter(seed=2)
    task = asyncio.ensure_future(fleet.apublish({"a": Held(dict(a2.tensors), a2.config)}, versions={"a": 2}))
    while not started.is_set():
        await asyncio.sleep(0.01)
    task.cancel()
    try: await task
    except asyncio.CancelledError: pass
    threading.Timer(HOLD, release.set).start()
    t = time.monotonic(); gone = await fleet.aretire("a", timeout=5); print("retire took", round(time.monotonic() - t, 2), gone)
    await asyncio.to_thread(ended.wait, 10); await asyncio.sleep(0.3)
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    print("under root after retire + late write:", left)
    print("LIVE runs of a:", [str(p) for p in LIVE if p.parent.name == "a"])
    await fleet.aregister("a", grace=0.0)
    r = await fleet.apublish({"a": tiny_llama_adapter(seed=3)}, versions={"a": 3})
    print("re-register round ok:", r.ok if hasattr(r, "ok") else r)
    t = time.monotonic(); await fleet.aclose(); print("close took", round(time.monotonic() - t, 2))
    return left

left = asyncio.run(main())
bad = [p for p in left if p.startswith("a/")]
assert not bad, f"retired tenant left files behind: {bad}"
print("held")
