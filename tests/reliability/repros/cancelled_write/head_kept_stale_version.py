"""[HEAD f1deeb2] `kept` makes an abandoned write's version permanent once a retry of that version
has started past the bound, whatever happens to the retry:
  MODE=newcontent: the retry carries new tensors (the trainer moved on); the abandoned write (old
    tensors) renames v2 first, is kept, so the retry fails ("published concurrently with different
    content") and every later publish of v2 fails ("already published ... immutable"); the stale,
    never-served v2 stays in the run after close.
  MODE=cancelagain: the retry (same tensors) is itself cancelled mid-write (wait_for again); the
    kept abandoned write leaves v2 in the run: never served, never recorded, still there after
    close() -- the very symptom of the original CI failure.
Both writes run on the same slow disk (each held until released), the first finishing first."""
import asyncio, os, sys, tempfile, threading, time
from pathlib import Path
from lorasync import Publisher
from lorasync.adapter._adapter import Adapter
from lorasync.testing import MemoryEngine, tiny_llama_adapter
from lorasync.transports import disk as D

MODE = os.environ.get("MODE", "newcontent")
D.ABANDONED_WRITE_WAIT_S = 0.3  # stands in for writes slower than the real 5 s bound
root = Path(os.environ["REPRO_ROOT"])
engine = MemoryEngine()
pub = Publisher([engine], name="p", keep=2, transport="disk", root=root, grace=0.0)

class Held(Adapter):
    def save_hashed(self, *args, **kw):
        self.started.set(); self.release.wait(3)
        return super().save_hashed(*args, **kw)

def held(seed):
    a = tiny_llama_adapter(seed=seed)
    h = Held(dict(a.tensors), a.config); h.started, h.release = threading.Event(), threading.Event()
    return h

async def cancel_mid_write(adapter, version):
    task = asyncio.ensure_future(pub.apublish(adapter, version=version))
    while not adapter.started.is_set():
        await asyncio.sleep(0.01)
    task.cancel()
    try: await task
    except asyncio.CancelledError: pass

async def main():
    await (await pub.apublish(tiny_llama_adapter(seed=1), version=1)).asettled()
    first = held(2)
    await cancel_mid_write(first, 2)
    if MODE == "newcontent":
        retry = held(22)
        task = asyncio.ensure_future(pub.apublish(retry, version=2))
        while not retry.started.is_set():
            await asyncio.sleep(0.01)
        first.release.set(); await asyncio.sleep(0.3)  # the older write ends first
        retry.release.set()
        r = await task; await r.asettled()
        print("retry:", r.ok, r.results[0].error)
        r2 = await pub.apublish(tiny_llama_adapter(seed=22), version=2)
        print("retry again:", r2.ok, r2.results[0].error)
        ok = r.ok or r2.ok
    else:
        retry = held(2)
        await cancel_mid_write(retry, 2)
        first.release.set(); await asyncio.sleep(0.3)
        retry.release.set(); await asyncio.sleep(0.3)
        ok = True
    await pub.aclose()
    return ok

ok = asyncio.run(main())
time.sleep(0.5)
run = next(root.glob("p/run-*"))
left = sorted(p.name for p in run.iterdir() if not p.name.startswith(".owner"))
print("engine serves:", engine.list_adapters(), "| run after close:", left)
assert ok, "v2 can never be published with the new content: a stale abandoned v2 was kept"
assert "v2" not in left or "p@v2" in engine.list_adapters(), "a v2 nobody served or recorded is left in the run after close"
print("held")
