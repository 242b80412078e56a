"""The script shape `asyncio.run(train())` then `pub.close()` then exit: a publish cancelled
mid-write (wait_for timeout) leaves its .tmp-v2-* folder in the run for good, because the sync
close() of a publisher driven with apublish skips _close_out/settle (its loop thread never ran)
and the interpreter exit kills the daemon write thread. Deterministic (write takes 1 s)."""
import os, subprocess, sys, tempfile
from pathlib import Path
if len(sys.argv) > 1:
    import asyncio, threading, time
    from lorasync import Publisher
    from lorasync.testing import MemoryEngine, tiny_llama_adapter
    from lorasync.transports import _store as S
    pub = Publisher([MemoryEngine()], name="p", keep=2, transport="disk", root=sys.argv[1], grace=0.0)
    real = S.seal_version
    def slow_seal(*a, **k):  # a slow disk: v2's fsync takes 1 s
        if str(a[1]).startswith(".tmp-v2-"): time.sleep(1.0)
        return real(*a, **k)
    S.seal_version = slow_seal
    async def train():
        await (await pub.apublish(tiny_llama_adapter(seed=1), version=1)).asettled()
        try:
            await asyncio.wait_for(pub.apublish(tiny_llama_adapter(seed=2), version=2), 0.3)
        except asyncio.TimeoutError:
            print("v2 timed out")
    asyncio.run(train())
    pub.close()
    sys.exit(0)
root = Path(os.environ["REPRO_ROOT"])
subprocess.run([sys.executable, __file__, str(root)], check=True)
left = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.startswith((".tmp-", ".trash-")))
print("after the process ended:", left)
sys.exit(1 if left else 0)
