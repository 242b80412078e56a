"""[4a7d864] The retry of a cancelled version, past the ABANDONED_WRITE_WAIT_S bound, can ADOPT the
abandoned write's directory (it finds v2 there with the same content: written 0, new=False), load
it and report ok; the abandoned thread then removes v2 by name (it wrote it, written>0), so the
engine serves p@v2 whose directory is gone. Window: between the abandoned write's rename into v2
and its removal, widened here by a slow store.remove (0.5 s, a slow filesystem); the write itself
ends just before the 5 s bound, as a slow disk's would. (Fixed at f1deeb2 by `kept`.)"""
import os
import asyncio, sys, tempfile, threading, time
from pathlib import Path
from lorasync import Publisher
from lorasync.adapter._adapter import Adapter
from lorasync.testing import MemoryEngine, tiny_llama_adapter
from lorasync.transports import disk as D

root = Path(os.environ["REPRO_ROOT"])
engine = MemoryEngine()
pub = Publisher([engine], name="p", keep=2, transport="disk", root=root, grace=0.0)
started, release = threading.Event(), threading.Event()

class SlowAdapter(Adapter):
    def save_hashed(self, *args, **kw):  # the slow disk: this write of v2 takes ~5 s
        started.set(); release.wait(3)
        return super().save_hashed(*args, **kw)

real_remove = pub.store.remove
def slow_remove(name, version):  # a slow filesystem: the removal lands a little later
    time.sleep(0.5); return real_remove(name, version)
pub.store.remove = slow_remove
base2 = tiny_llama_adapter(seed=2)

async def main():
    await (await pub.apublish(tiny_llama_adapter(seed=1), version=1)).asettled()
    task = asyncio.ensure_future(pub.apublish(SlowAdapter(dict(base2.tensors), base2.config), version=2))
    while not started.is_set():
        await asyncio.sleep(0.01)
    task.cancel()
    try: await task
    except asyncio.CancelledError: pass
    threading.Timer(D.ABANDONED_WRITE_WAIT_S - 0.1, release.set).start()
    report = await pub.apublish(tiny_llama_adapter(seed=2), version=2)  # the trainer retries step 2
    await report.asettled()
    return report

report = asyncio.run(main())
time.sleep(1.0)
v2 = pub.store.path_for("p", 2)
print("retry ok:", report.ok, "| engine lists:", engine.list_adapters(), "| v2 dir exists:", v2.is_dir())
assert not (report.ok and "p@v2" in engine.list_adapters() and not v2.is_dir()), "engine serves p@v2 but the abandoned write removed its directory"
print("held")
