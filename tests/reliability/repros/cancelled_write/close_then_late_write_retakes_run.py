"""Bug: a write abandoned by a cancelled publish that outlasts close()'s bound (ABANDONED_WRITE_WAIT_S,
5 s: a slow disk) removes its version after close through DiskStore.remove -> _run -> own(), which
takes the run AGAIN for the closed store (LIVE + _owner). The closed publisher now holds the run
forever: resuming it with Publisher(run=same) in this process fails with ConfigError ("in use by
another publisher of this process"), although the owner was closed."""
import os
import asyncio, sys, tempfile, threading, time
from pathlib import Path
from lorasync import Publisher
from lorasync.errors import ConfigError
from lorasync.testing import MemoryEngine, tiny_llama_adapter
from lorasync.transports import disk as D
from lorasync.transports._owned import LIVE

D.ABANDONED_WRITE_WAIT_S = 0.3  # stands in for a write slower than the real 5 s bound
root = Path(os.environ["REPRO_ROOT"])
pub = Publisher([MemoryEngine()], name="p", keep=2, transport="disk", root=root, run="r1", grace=0.0)
started, release, ended = threading.Event(), threading.Event(), threading.Event()

from lorasync.adapter._adapter import Adapter
class SlowAdapter(Adapter):
    def save_hashed(self, *args, **kw):  # the slow disk: the files of v2 take long to write
        started.set(); release.wait(30)
        try: return super().save_hashed(*args, **kw)
        finally: threading.Timer(0.2, ended.set).start()

def slow_adapter(seed):
    a = tiny_llama_adapter(seed=seed)
    return SlowAdapter(dict(a.tensors), a.config)

async def main():
    await (await pub.apublish(tiny_llama_adapter(seed=1), version=1)).asettled()
    task = asyncio.ensure_future(pub.apublish(slow_adapter(2), version=2))
    while not started.is_set():
        await asyncio.sleep(0.01)
    task.cancel()
    try: await task
    except asyncio.CancelledError: pass
    await pub.aclose()

asyncio.run(main())
run_dir = pub.store.run_dir("p")
print("after close: LIVE has run:", run_dir in LIVE)
release.set(); ended.wait(10); time.sleep(0.3)
print("after the late write ended: LIVE has run:", run_dir in LIVE, "closed store _owner:", pub.store._owner)
print("leftovers:", [p.name for p in run_dir.iterdir() if p.name.startswith((".tmp", ".trash", "v"))])
try:
    again = Publisher([MemoryEngine()], name="p", keep=2, transport="disk", root=root, run="r1", grace=0.0)
    r = again.publish(tiny_llama_adapter(seed=3), version=3)
    print("resume:", r.ok, r.results[0].error)
    again.close()
    err = r.results[0].error
    assert r.ok, f"resuming the closed publisher's run fails: {err!r}"
except ConfigError as exc:
    print("resume refused:", exc); sys.exit(1)
print("OK")
