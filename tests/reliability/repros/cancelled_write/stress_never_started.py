"""Natural trigger of never_started_job.py: asyncio.wait_for(apublish, tiny random timeout) in a
loop, nothing patched, idle pool. Exits 1 at the first publish after a cancel that waits ~5 s
(a cancelled write that never ran stays 'abandoned' for good)."""
import os
import asyncio, random, sys, tempfile, time
from pathlib import Path
from lorasync import Publisher
from lorasync.testing import MemoryEngine, tiny_llama_adapter

random.seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
root = Path(os.environ["REPRO_ROOT"])
pub = Publisher([MemoryEngine()], name="p", keep=2, transport="disk", root=root, grace=0.0)
adapters = [tiny_llama_adapter(seed=i) for i in range(4)]

async def main():
    await (await pub.apublish(adapters[0], version=1)).asettled()  # warm-up (first write is slow)
    for v in range(2, 400):
        try:
            await asyncio.wait_for(pub.apublish(adapters[v % 4], version=v), random.uniform(0, 0.004))
        except asyncio.TimeoutError:
            t = time.monotonic()
            await (await pub.apublish(adapters[v % 4], version=v)).asettled()  # the retry
            stuck = [j.ended.done() for j in pub._disk._abandoned]
            if time.monotonic() - t > 3 and False in stuck:
                return f"after the cancel of v{v}: the retry took {time.monotonic() - t:.1f} s; abandoned jobs ended? {stuck}"
    return None

bad = asyncio.run(main())
print(bad or "no stall in 400 iterations")
sys.exit(1 if bad else 0)
