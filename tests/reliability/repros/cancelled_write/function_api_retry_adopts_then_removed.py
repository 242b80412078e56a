"""apublish_adapter (the stateless function API) makes a throwaway Publisher + DiskTransport per
call on the process's one run. A call cancelled (wait_for) right after its write renamed v2 into
place (the directory fsync after the rename is slow) is released without settling its write, and
the retry's fresh DiskTransport has its own _slots, so nothing orders the two writes of v2: the
retry finds v2 (same content) and serves it, then the abandoned write's post-rename wanted() check
removes v2 under the engine. Result: the engine lists p@v2, report ok, directory gone.
Deterministic given the 1 s slow fsync after the rename."""
import asyncio, os, sys, tempfile, threading, time
from pathlib import Path
from lorasync import apublish_adapter
from lorasync.testing import MemoryEngine, tiny_llama_adapter

root = Path(os.environ["REPRO_ROOT"])
engine = MemoryEngine()
renamed = threading.Event()
real_rename = os.rename
def rename(src, dst, *a, **k):
    real_rename(src, dst, *a, **k)
    if str(src).startswith(".tmp-v2-") and not renamed.is_set():
        renamed.set(); time.sleep(1.0)  # the fsync of the run's folder after the rename: a slow disk
os.rename = rename

async def main():
    await apublish_adapter(tiny_llama_adapter(seed=1), [engine], name="p", version=1, transport="disk", root=root)
    task = asyncio.ensure_future(apublish_adapter(tiny_llama_adapter(seed=2), [engine], name="p", version=2, transport="disk", root=root))
    while not renamed.is_set():
        await asyncio.sleep(0.002)
    task.cancel()
    try: await task
    except asyncio.CancelledError: pass
    report = await apublish_adapter(tiny_llama_adapter(seed=2), [engine], name="p", version=2, transport="disk", root=root)  # the retry
    await asyncio.sleep(1.5)
    return report

report = asyncio.run(main())
v2 = next(root.glob("p/run-*")) / "v2"
print("retry ok:", report.ok, "| engine lists:", engine.list_adapters(), "| v2 dir exists:", v2.is_dir())
sys.exit(1 if report.ok and "p@v2" in engine.list_adapters() and not v2.is_dir() else 0)
