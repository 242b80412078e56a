"""A publish cancelled AFTER its disk write returned (here: while an async engine client is still
connecting, before the load reaches the engine) leaves v2 on disk, handed to nobody. The retry of
v2 with the trainer's newer tensors is refused (PublishError: already published with different
content), so the retry never serves its content. Deterministic."""
import asyncio, os, sys, tempfile
from pathlib import Path
from lorasync import Publisher
from lorasync.testing import MemoryEngine, tiny_llama_adapter

class SlowConnect(MemoryEngine):  # an async client whose load is slow to reach the server
    slow = False
    async def acapabilities(self): return self.capabilities()
    async def alist_adapters(self): return self.list_adapters()
    async def aadapter_sources(self): return self.adapter_sources()
    async def aadapters_in_use(self): return self.adapters_in_use()
    async def aunload_adapter(self, name): self.unload_adapter(name)
    async def aload_adapter(self, name, path):
        if self.slow:
            await asyncio.sleep(2)  # connecting; nothing sent yet
        self.load_adapter(name, path)

root = Path(os.environ["REPRO_ROOT"])
engine = SlowConnect()
pub = Publisher([engine], name="p", keep=2, transport="disk", root=root, grace=0.0)

async def main():
    await (await pub.apublish(tiny_llama_adapter(seed=1), version=1)).asettled()
    engine.slow = True
    try:
        await asyncio.wait_for(pub.apublish(tiny_llama_adapter(seed=2), version=2), 0.5)
    except asyncio.TimeoutError:
        pass
    engine.slow = False
    print("after cancel: engine lists", engine.list_adapters(), "| v2 on disk:", pub.store.path_for("p", 2).is_dir())
    report = await pub.apublish(tiny_llama_adapter(seed=22), version=2)  # retry, tensors moved on
    await report.asettled()
    return report

report = asyncio.run(main())
pub.close()
print("retry:", report.results[0].status, repr(report.results[0].error)[:200])
ok = report.ok and "p@v2" in engine.list_adapters() and pub.store.content_hash("p", 2) == tiny_llama_adapter(seed=22).content_hash
print("engine lists:", engine.list_adapters(), "| recorded hash ok:", pub.store.content_hash("p", 2) == tiny_llama_adapter(seed=22).content_hash)
sys.exit(0 if ok else 1)
