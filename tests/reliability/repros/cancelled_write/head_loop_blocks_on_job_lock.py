"""[HEAD f1deeb2] The retry of a cancelled version, past the ABANDONED_WRITE_WAIT_S bound, takes
the abandoned job's threading.Lock ON THE EVENT LOOP (`with left.lock: left.kept = True`), while the
abandoned thread holds that lock across its store.remove. A slow/stuck filesystem during that
removal freezes the whole event loop: no other task runs, and asyncio.wait_for cannot time the
publish out (the bound meant to keep a stuck disk from holding the next publish is defeated)."""
import os
import asyncio, sys, tempfile, threading, time
from pathlib import Path
from lorasync import Publisher
from lorasync.adapter._adapter import Adapter
from lorasync.testing import MemoryEngine, tiny_llama_adapter
from lorasync.transports import disk as D

root = Path(os.environ["REPRO_ROOT"])
pub = Publisher([MemoryEngine()], name="p", keep=2, transport="disk", root=root, grace=0.0)
started, release = threading.Event(), threading.Event()
STUCK_S = 4.0

class SlowAdapter(Adapter):
    def save_hashed(self, *args, **kw):  # slow disk
        started.set(); release.wait(3)
        return super().save_hashed(*args, **kw)

real_remove = pub.store.remove
def stuck_remove(name, version):  # the disk stalls while the abandoned write removes v2
    time.sleep(STUCK_S); return real_remove(name, version)
pub.store.remove = stuck_remove
a2 = tiny_llama_adapter(seed=2)

async def heartbeat(gaps):
    last = time.monotonic()
    while True:
        await asyncio.sleep(0.05)
        now = time.monotonic(); gaps.append(now - last); last = now

async def main():
    await (await pub.apublish(tiny_llama_adapter(seed=1), version=1)).asettled()
    task = asyncio.ensure_future(pub.apublish(SlowAdapter(dict(a2.tensors), a2.config), version=2))
    while not started.is_set():
        await asyncio.sleep(0.01)
    task.cancel()
    try: await task
    except asyncio.CancelledError: pass
    threading.Timer(D.ABANDONED_WRITE_WAIT_S - 0.2, release.set).start()  # ends just inside the bound...
    gaps = []; hb = asyncio.ensure_future(heartbeat(gaps))
    t0 = time.monotonic(); timed_out = False
    try:  # ...its removal then stalls; the retry should give up at most ~1 s past the bound
        await asyncio.wait_for(pub.apublish(tiny_llama_adapter(seed=2), version=2), D.ABANDONED_WRITE_WAIT_S + 0.5)
    except asyncio.TimeoutError:
        timed_out = True
    took = time.monotonic() - t0
    hb.cancel()
    return max(gaps), took, timed_out

gap, took, timed_out = asyncio.run(main())
print(f"longest event-loop stall: {gap:.2f} s; retry returned after {took:.2f} s (wait_for limit {D.ABANDONED_WRITE_WAIT_S + 0.5} s, timed out: {timed_out})")
assert gap < 1.0, f"the event loop was blocked {gap:.2f} s on the abandoned job's threading.Lock"
print("held")
