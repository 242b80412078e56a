"""Variant of retry_new_content_after_cancel_in_load: the 'unchanged' path. v2 republishes v1's
content; stage() writes v2 only to learn its hash, and discard() would remove it at the end of the
publish. A cancel while the engine is re-listed (slow list) skips the discard: v2 stays on disk,
handed to nobody, and the retry of v2 with the trainer's new tensors fails with PublishError.
Deterministic."""
import os
import asyncio, sys, tempfile
from pathlib import Path
from lorasync import Publisher
from lorasync.testing import MemoryEngine, tiny_llama_adapter

class SlowList(MemoryEngine):
    slow = False
    async def acapabilities(self): return self.capabilities()
    async def _maybe(self):
        if self.slow: await asyncio.sleep(2)
    async def alist_adapters(self): await self._maybe(); return self.list_adapters()
    async def aadapter_sources(self): await self._maybe(); return self.adapter_sources()
    async def aadapters_in_use(self): return self.adapters_in_use()
    async def aunload_adapter(self, name): self.unload_adapter(name)
    async def aload_adapter(self, name, path): self.load_adapter(name, path)

root = Path(os.environ["REPRO_ROOT"])
engine = SlowList()
pub = Publisher([engine], name="p", keep=2, transport="disk", root=root, grace=0.0)

async def main():
    await (await pub.apublish(tiny_llama_adapter(seed=1), version=1)).asettled()
    engine.slow = True
    try:  # same content as v1 under v2: 'unchanged'
        await asyncio.wait_for(pub.apublish(tiny_llama_adapter(seed=1), version=2), 0.5)
    except asyncio.TimeoutError:
        pass
    engine.slow = False
    print("after cancel: engine lists", engine.list_adapters(), "| v2 on disk:", pub.store.path_for("p", 2).is_dir())
    report = await pub.apublish(tiny_llama_adapter(seed=22), version=2)
    await report.asettled()
    return report

report = asyncio.run(main())
pub.close()
print("retry:", report.results[0].status, repr(report.results[0].error)[:160])
sys.exit(0 if report.ok and "p@v2" in engine.list_adapters() else 1)
