"""Publisher driven with apublish (its own loop thread never started), closed with the sync
pub.close() after asyncio.run returns (the common script shape). close() only runs _close_out
(which settles abandoned writes) when the loop thread runs or a background phase is pending, so it
returns at once while the cancelled publish's write is still in the run: its .tmp-v2-* folder is
there after close returns. Deterministic (the write takes 0.5 s here, well inside the 5 s bound)."""
import os
import asyncio, sys, tempfile, threading, time
from pathlib import Path
from lorasync import Publisher
from lorasync.testing import MemoryEngine, tiny_llama_adapter
from lorasync.transports import _store as S

root = Path(os.environ["REPRO_ROOT"])
pub = Publisher([MemoryEngine()], name="p", keep=2, transport="disk", root=root, grace=0.0)
started = threading.Event()
real_seal = S.seal_version
def slow_seal(*a, **k):  # a slow disk: fsync of v2's files takes 0.5 s
    if str(a[1]).startswith(".tmp-v2-"):
        started.set(); time.sleep(0.5)
    return real_seal(*a, **k)
S.seal_version = slow_seal

async def main():
    await (await pub.apublish(tiny_llama_adapter(seed=1), version=1)).asettled()
    task = asyncio.ensure_future(pub.apublish(tiny_llama_adapter(seed=2), version=2))
    while not started.is_set():
        await asyncio.sleep(0.005)
    task.cancel()
    try: await task
    except asyncio.CancelledError: pass

asyncio.run(main())
t = time.monotonic(); pub.close(); dt = time.monotonic() - t
left = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.startswith((".tmp-", ".trash-")))
print(f"close took {dt:.2f}s; temp folders right after close: {left}")
time.sleep(1.0)
print("a second later:", sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.startswith((".tmp-", ".trash-"))), "versions:", pub.store.versions("p"))
# (A script that exits right after close() kills the daemon write thread: the .tmp-v2-* folder then
# stays in the run, in /dev/shm by default, for good.)
sys.exit(1 if left else 0)
