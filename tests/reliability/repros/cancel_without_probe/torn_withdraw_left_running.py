"""A torn in-place delivery's withdrawal, cancelled past its bound, is the next publish's to wait
for: the swap back (or unload) landing after v3's swap would serve v1 (or nothing) under a report
that says v3 serves, and a late ledger write would make a later v3 'unchanged' against it.

Held before settle_to_the_end too (the withdrawal's engine calls were tracked; the work after them
was not); kept as the end-to-end check: the next publish fails typed while the withdrawal runs, then
serves v3 exactly, and v3's content again is 'unchanged'.

Run: .venv/bin/python tests/reliability/repros/cancel_without_probe/torn_withdraw_left_running.py
"""
import asyncio, os, sys, threading, time
sys.path.insert(0, os.environ.get("REPO", os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))))
import lorasync.publisher._cancelled as _cancelled
_cancelled.CANCELLED_CALL_WAIT_S = 0.5
from tests.reliability.test_cancel_without_probe import step, trainer, served, lora_state, same
from lorasync import Publisher
from lorasync.engines.peft import PeftEngine
from lorasync.exporters import fsdp
from lorasync.testing import make_tiny_model


class Engine(PeftEngine):
    mode = None  # "torn": the swap waits for the trainer's step; then the withdrawal hangs

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.swapping, self.stepped, self.withdrawing, self.release = (threading.Event() for _ in range(4))
        self.calls = 0

    def _hold(self):
        if self.mode == "torn":
            self.calls += 1
            if self.calls == 1:
                self.swapping.set()
                self.stepped.wait(10)  # the trainer steps while the swap reads its tensors
            else:
                self.withdrawing.set()
                self.release.wait(10)  # the withdrawal waits on the engine

    def replace_adapter_tensors(self, name, adapter):
        self._hold()
        return super().replace_adapter_tensors(name, adapter)

    def unload_adapter(self, name):
        self._hold()
        return super().unload_adapter(name)


async def main():
    policy, optimizer = trainer()
    engine = Engine(make_tiny_model(seed=0))
    pub = Publisher([engine], name="policy", transport="ipc", in_place=True)
    step(policy, optimizer, 1)
    assert (await pub.apublish(fsdp.export(policy), version=1)).ok
    step(policy, optimizer, 2)
    engine.mode = "torn"
    task = asyncio.ensure_future(pub.apublish(fsdp.export(policy), version=2))  # no copy: live tensors
    while not engine.swapping.is_set():
        await asyncio.sleep(0.005)
    step(policy, optimizer, 22)  # the trainer steps under the swap: torn
    engine.stepped.set()
    while not engine.withdrawing.is_set():
        await asyncio.sleep(0.005)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=3.0)
    print("cancel returned:", bool(done))
    assert done
    engine.mode = None
    threading.Timer(1.0, engine.release.set).start()  # the withdrawal ends 1 s from now
    step(policy, optimizer, 3)
    v3 = lora_state(policy)
    r = await pub.apublish(fsdp.export(policy, copy=True), version=3)
    print("v3:", r.results[0].status, repr(r.results[0].error)[:150])
    if not r.ok:
        await asyncio.sleep(1.5)
        r = await pub.apublish(fsdp.export(policy, copy=True), version=3)
        print("v3 again:", r.results[0].status, repr(r.results[0].error)[:150])
    assert r.ok, r.results[0]
    await asyncio.sleep(1.5)  # whatever the withdrawal still had to do is done now
    assert same(served(engine, "policy"), v3), "v3 was reported served, the engine serves other weights"
    r = await pub.apublish(fsdp.export(policy, copy=True), version=4)  # same content as v3
    print("v4 (v3's content):", r.results[0].status)
    assert r.ok and same(served(engine, "policy"), v3)
    await pub.aclose()


asyncio.run(main())
print("OK")
