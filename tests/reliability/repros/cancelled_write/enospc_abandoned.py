"""Abandoned write that fails with ENOSPC (disk full mid-write), then retry same version and close."""
import os
import asyncio, errno, sys, tempfile, threading, time
from pathlib import Path
from lorasync import Publisher
from lorasync.adapter._adapter import Adapter
from lorasync.testing import MemoryEngine, tiny_llama_adapter

root = Path(os.environ["REPRO_ROOT"])
engine = MemoryEngine()
pub = Publisher([engine], name="p", keep=1, transport="disk", root=root, grace=0.0)
started, release = threading.Event(), threading.Event()
class Full(Adapter):
    def save_hashed(self, path, *a, **k):
        started.set(); release.wait(30)
        super().save_hashed(path, *a, **k)
        raise OSError(errno.ENOSPC, "No space left on device")
async def main():
    await (await pub.apublish(tiny_llama_adapter(seed=1), version=1)).asettled()
    a2 = tiny_llama_adapter(seed=2)
    task = asyncio.ensure_future(pub.apublish(Full(dict(a2.tensors), a2.config), version=2))
    while not started.is_set(): await asyncio.sleep(0.01)
    task.cancel()
    try: await task
    except asyncio.CancelledError: pass
    threading.Timer(0.3, release.set).start()
    t = time.monotonic(); r = await pub.apublish(tiny_llama_adapter(seed=2), version=2); await r.asettled()
    print("retry ok", r.ok, round(time.monotonic() - t, 2))
    t = time.monotonic(); await pub.aclose(); print("close", round(time.monotonic() - t, 2))
    return r
r = asyncio.run(main())
left = sorted(p.name for p in root.rglob("*") if p.name.startswith((".tmp", ".trash")))
print("leftovers", left, "versions", pub.store.versions("p"), "engine", engine.list_adapters())
assert r.ok and not left
print("held")
