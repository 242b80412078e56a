"""Bug: a publish cancelled while its disk write is still QUEUED in lorasync's thread pool (not yet
taken by a worker) never runs the write, so _Job.ended is never set. The job stays in
DiskTransport._abandoned forever and EVERY later publish (any version) and close() waits the full
ABANDONED_WRITE_WAIT_S (5 s).

Setup (no lorasync internals patched): lorasync's shared I/O pool (32 daemon threads) is busy with
another publisher's engine calls to 32 slow engines (a sync Engine's a-twins run in that pool);
the victim publisher uses an async engine client. asyncio.wait_for(victim.apublish(v2), 0.5) times
out while the write is queued; the slow engines then recover."""
import os
import asyncio, sys, tempfile, threading, time
from pathlib import Path
from lorasync import Publisher
from lorasync.testing import MemoryEngine, tiny_llama_adapter

root = Path(os.environ["REPRO_ROOT"])
gate = threading.Event()

class SlowEngine(MemoryEngine):  # a sync engine whose server is stuck for a while
    def list_adapters(self):
        gate.wait(30)
        return super().list_adapters()
    def adapter_sources(self):
        gate.wait(30)
        return super().adapter_sources()
    def capabilities(self):
        gate.wait(30)
        return super().capabilities()

class AsyncEngine(MemoryEngine):  # an async client: its calls need no thread
    async def acapabilities(self): return self.capabilities()
    async def alist_adapters(self): return self.list_adapters()
    async def aadapter_sources(self): return self.adapter_sources()
    async def aadapters_in_use(self): return self.adapters_in_use()
    async def aload_adapter(self, name, path): self.load_adapter(name, path)
    async def aunload_adapter(self, name): self.unload_adapter(name)

victim = Publisher([AsyncEngine()], name="victim", keep=2, transport="disk", root=root, grace=0.0)
other = Publisher([SlowEngine(url=f"memory://slow{i}") for i in range(32)], name="other", transport="disk", root=root, grace=0.0)

async def main():
    await (await victim.apublish(tiny_llama_adapter(seed=1), version=1)).asettled()
    busy = asyncio.ensure_future(other.apublish(tiny_llama_adapter(seed=9), version=1))
    await asyncio.sleep(0.3)
    from lorasync.runtime import _loop
    print("shared pool threads:", len(_loop._SHARED._threads), "free:", _loop._SHARED._free)  # the shared pool's 32 threads now wait on the slow engines
    try:
        await asyncio.wait_for(victim.apublish(tiny_llama_adapter(seed=2), version=2), 0.5)
        print("v2 was not cancelled (setup did not reach the window)"); return None
    except asyncio.TimeoutError:
        pass
    gate.set()
    await (await busy).asettled()
    await asyncio.sleep(0.5)
    print("victim's abandoned jobs (ended?):", [j.ended.done() for j in victim._disk._abandoned])
    times = []
    for v in (3, 4, 5):
        t = time.monotonic()
        await (await victim.apublish(tiny_llama_adapter(seed=v), version=v)).asettled()
        times.append(round(time.monotonic() - t, 2))
    t = time.monotonic(); await victim.aclose(); times.append(round(time.monotonic() - t, 2))
    await other.aclose()
    return times

times = asyncio.run(main())
print("victim publish v3, v4, v5 and close, seconds:", times)
assert times is not None and max(times) < 2, f"every later publish/close waits ~5 s for a write that never runs: {times}"
print("OK")
