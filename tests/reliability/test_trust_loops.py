"""Event loops, lifecycle and ownership (issue 33, items 12, 13, 15, 17, 18): no sync call waits
on a loop it runs on, a pin never waits, nothing a publisher owns outlives it, and no exit or
publish waits out an engine call that nobody needs any more.

Every call that could hang runs under a bound, so a regression fails instead of hanging; the
timing bounds are far above what the fixed code takes and far below what the bugs cost.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lorasync import Publisher
from lorasync.errors import BlockingCallError, EngineTimeoutError
from lorasync.testing import MemoryEngine
from tests.reliability.test_trust_lifecycle import BOUND_S, bounded
from tests.support.adapters import tiny_adapter as adapter

REPO = Path(__file__).resolve().parents[2]


class Gated(MemoryEngine):
    """A server whose loads of ``gated`` wait for ``go``; ``loading`` says one started."""

    def __init__(self, gated: str) -> None:
        super().__init__()
        self.gated = gated
        self.loading = threading.Event()
        self.go = threading.Event()

    def load_adapter(self, name, path):
        if name == self.gated:
            self.loading.set()
            if not self.go.wait(BOUND_S):
                raise EngineTimeoutError("the test never let the load go", engine=self.kind)
        super().load_adapter(name, path)


# -- item 12: lease/pin from a coroutine while apublish runs on its loop ---------------------------


@pytest.mark.parametrize("when", ["before the publish started", "while the engine loads"])
def test_a_sync_lease_in_a_coroutine_while_apublish_runs_pins_and_never_waits(tmp_path, when):
    # 090ffbd: refused or passed depending on whether the publish had reached the loop yet (the
    # same program, two outcomes); reported as a deadlock. A pin is a counter: it never waits, so
    # it is safe anywhere, and the retirement running meanwhile keeps the leased version.
    engine = Gated("p@v2")
    pub = Publisher([engine], name="p", keep=1, root=tmp_path, grace=0.0)

    async def trainer() -> tuple[Any, list[str], list[str]]:
        await (await pub.apublish(adapter(1), version=1)).asettled()
        publishing = asyncio.ensure_future(pub.apublish(adapter(2), version=2))
        if when == "while the engine loads":
            while not engine.loading.is_set():
                await asyncio.sleep(0.01)
        with pub.lease(1) as model:
            pub.pin(1)
            pub.unpin(1)
            assert model == "p@v1" and pub.pinned == frozenset({1})
            engine.go.set()
            report = await (await publishing).asettled()
            leased = engine.list_adapters()
        assert pub.pinned == frozenset()
        await pub.acollect()
        after = engine.list_adapters()
        await pub.aclose()
        return report, leased, after

    report, leased, after = bounded(asyncio.run, trainer(), what="lease() from the loop running apublish")
    assert report.ok and report.results[0].retired == [], report
    assert sorted(leased) == ["p@v1", "p@v2"]  # the leased version stayed loaded
    assert after == ["p@v2"]  # and retired once the lease ended


# -- items 13 and 17: no exit waits out an engine call nobody needs any more -------------------------


class SlowUnload(MemoryEngine):
    """A server whose unloads take until ``release`` (a slow background retirement)."""

    def __init__(self) -> None:
        super().__init__()
        self.unloading = threading.Event()
        self.release = threading.Event()

    def unload_adapter(self, name):
        self.unloading.set()
        self.release.wait(BOUND_S)
        super().unload_adapter(name)


def test_leaving_a_sync_with_in_async_code_after_apublish_raises_at_once(tmp_path):
    # 090ffbd: the BlockingCallError was raised at once inside the coroutine, but asyncio.run then
    # waited for its executor thread, still in the slow unload of the retirement, before the
    # error reached the caller: 9.7 s of stall, then the error.
    engine = SlowUnload()
    seen: dict[str, float] = {}

    async def trainer() -> None:
        with Publisher([engine], name="p", keep=1, root=tmp_path, grace=0.0) as pub:
            await pub.apublish(adapter(1), version=1)
            await pub.apublish(adapter(2), version=2)
            while not engine.unloading.is_set():  # the retirement of v1 is in the engine
                await asyncio.sleep(0.01)
            seen["left"] = time.monotonic()

    try:
        with pytest.raises(BlockingCallError, match=r"await pub\.aclose\(\)"):
            bounded(asyncio.run, trainer(), what="leaving `with Publisher` in async code")
        stall = time.monotonic() - seen["left"]
    finally:
        engine.release.set()
    assert stall < 3.0, f"the error reached the caller {stall:.1f} s after the block was left"


def _ending_script(unload: str, *, last_line_after: float) -> str:
    """A script that publishes v1 and v2 and ends while v2's background retirement unloads v1 in
    ``unload`` (the body of the engine's ``unload_adapter``, before the unload itself)."""
    return textwrap.dedent(
        """
        import sys, time
        import torch
        from lorasync import Publisher
        from lorasync.testing import MemoryEngine
        from tests.support.adapters import tiny_adapter as adapter

        class Engine(MemoryEngine):
            def unload_adapter(self, name):
        %s
                super().unload_adapter(name)

        pub = Publisher([Engine()], name="p", keep=1, root=sys.argv[1], grace=0.0)
        pub.publish(adapter(1), version=1)
        pub.publish(adapter(2), version=2)  # its retirement of v1 runs on, in the background
        time.sleep(%r)
        print("END", time.monotonic(), flush=True)
        """
    ) % (textwrap.indent(textwrap.dedent(unload), " " * 8), last_line_after)


_SCRIPT = _ending_script("time.sleep(60)  # the engine takes its time; the script is done", last_line_after=0.5)


def test_a_script_that_never_closes_its_publisher_exits_promptly(tmp_path):
    # 090ffbd: the interpreter joined the executor thread stuck in the background unload (13.6 s),
    # then printed "cannot schedule new futures after shutdown" from the retirement.
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=BOUND_S,
    )
    ended = time.monotonic()
    assert proc.returncode == 0, proc.stderr
    last = float(proc.stdout.split("END")[-1])
    assert ended - last < 5.0, f"the script took {ended - last:.1f} s to exit after its last line"
    assert "Traceback" not in proc.stderr, proc.stderr


_TORCH_AT_EXIT = _ending_script(
    """
    time.sleep(0.3)  # the script's last line runs meanwhile
    a, began = torch.randn(300, 300), time.monotonic()
    while time.monotonic() - began < 0.6:  # short C++ calls with the GIL let go, for 0.6 s
        a = a @ a.T / 300  # however loaded the box: one of them ends while the interpreter does
    """,
    last_line_after=0.35,
)


def test_a_script_that_ends_while_an_engine_call_runs_torch_code_exits_cleanly(tmp_path):
    # CI of 8569189: a repro script's last line ran, then the process aborted ("terminate called
    # without an active exception", -6): a lorasync daemon thread came back from torch while the
    # interpreter finalized. This script aborted 5 of 5 runs before the exit waited for such calls.
    for attempt in range(3):
        proc = subprocess.run(
            [sys.executable, "-c", _TORCH_AT_EXIT, str(tmp_path / str(attempt))],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=BOUND_S,
        )  # fmt: skip
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
        assert "END" in proc.stdout and "terminate called" not in proc.stderr, proc.stderr[-2000:]


_NEXT_CALL_AT_EXIT = r"""
import sys, time, tempfile, threading
import atexit, json, os, torch

class MetricsWriter:  # a TensorBoard / wandb-like writer: a thread flushes, close() joins it
    def __init__(self):
        self.path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._flush_loop, daemon=True)
        self.thread.start()
    def _flush_loop(self):
        self.closing.wait()
        time.sleep(0.2)  # the last batch goes out
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": 4}) + "\n")
    def close(self):
        self.closing.set()
        self.thread.join()

writer = MetricsWriter()
atexit.register(writer.close)  # registered before lorasync is imported: runs after its drain
from lorasync import Publisher
from lorasync.testing import MemoryEngine
from tests.support.adapters import tiny_adapter as adapter

ended, entered = threading.Event(), threading.Event()

def torch_work(s):
    a, began = torch.randn(300, 300), time.monotonic()
    while time.monotonic() - began < s:  # short C++ calls with the GIL let go
        a = a @ a.T / 300

class Engine(MemoryEngine):
    armed = False
    def unload_adapter(self, name):
        if self.armed:
            if name.endswith("@v1"):
                entered.set()
                ended.wait(10)
                time.sleep(0.3)  # the engine takes a moment; the script's last line has run
            else:
                torch_work(0.6)  # the retirement's next unload
        super().unload_adapter(name)

engine = Engine()
pub = Publisher([engine], name="p", keep=1, root=tempfile.mkdtemp(), grace=0.0)
pub.pin(1); pub.pin(2)
pub.publish(adapter(1), version=1)
pub.publish(adapter(2), version=2)
pub.publish(adapter(3), version=3).settled()  # its retirement (nothing: v1, v2 pinned) ends
pub.unpin(1); pub.unpin(2)
engine.armed = True
pub.publish(adapter(4), version=4)  # retires v1, v2, v3 one after the other
entered.wait(10)  # (the retirement is under way)
print("END", flush=True)
ended.set()
"""


def test_a_script_that_ends_while_a_retirement_unloads_several_versions_exits_cleanly(tmp_path):
    # Outside attack on 4acc091: the exit's wait ended with the first unload, and the loop thread
    # (alive to the end) started the next one, in torch, as the interpreter finalized: -6 again,
    # 3 of 3 runs. No call starts once the interpreter exits now.
    for attempt in range(3):
        proc = subprocess.run(
            [sys.executable, "-c", _NEXT_CALL_AT_EXIT], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True, text=True, timeout=BOUND_S,
        )  # fmt: skip
        assert proc.returncode == 0 and "END" in proc.stdout, (attempt, proc.returncode, proc.stderr[-2000:])


_FORKED_CHILD = """
import os, sys, tempfile, threading, time
from lorasync import Publisher
from lorasync.testing import MemoryEngine
from tests.support.adapters import tiny_adapter as adapter

class SlowUnload(MemoryEngine):
    def __init__(self):
        super().__init__()
        self.unloading = threading.Event()
    def unload_adapter(self, name):
        self.unloading.set()
        time.sleep(8)  # a slow engine unload, in the publisher's background retirement
        super().unload_adapter(name)

def child_exit_seconds(drain):
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the worker does nothing with lorasync and exits normally
        if not drain:  # the baseline: the same child with the exit's wait off
            import lorasync.runtime._pool as _pool
            _pool.EXIT_WAIT_S = 0.0
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    return time.monotonic() - t0

engine = SlowUnload()
pub = Publisher([engine], name="p", keep=1, root=sys.argv[1], grace=0.0)
pub.publish(adapter(1), version=1)
pub.publish(adapter(2), version=2)  # its retirement of v1 runs on in the background
assert engine.unloading.wait(10)
base, during = child_exit_seconds(False), child_exit_seconds(True)
print("EXTRA", during - base, flush=True)
os._exit(0)  # the parent does not wait for the slow unload
"""


def test_a_forked_child_exits_without_waiting_for_its_parents_calls(tmp_path):
    # Outside attack on 4acc091: the publisher loop's pool was not reset in a forked child, whose
    # exit then waited the full 2 s for a call that ran only in its parent (1.6-2.0 s more).
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_FORKED_CHILD), str(tmp_path)], cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=BOUND_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    extra = float(proc.stdout.split("EXTRA")[-1])
    assert extra < 1.0, f"a forked child's exit waited {extra:.2f} s more for a call that runs only in its parent"


_HOOK_BEFORE_IMPORT = r"""
import atexit, os, sys, tempfile, time

state = {}

def publish_final_step():  # the trainer's shutdown hook, registered before lorasync is imported
    pub = state["pub"]
    report = pub.publish(adapter(3), version=3)
    print("FINAL", report.ok, report.results[0].status, flush=True)
    pub.close()
    files = sorted(d for _, ds, _ in os.walk(sys.argv[1]) for d in ds if d.startswith("v"))
    print("CLOSED", sorted(state["engine"].list_adapters()), files, flush=True)

atexit.register(publish_final_step)  # atexit runs it after lorasync's own exit hook

from lorasync import Publisher
from lorasync.testing import MemoryEngine
from tests.support.adapters import tiny_adapter as adapter

state["engine"] = MemoryEngine()
pub = Publisher([state["engine"]], name="p", keep=1, root=sys.argv[1], grace=0.0)
state["pub"] = pub
assert pub.publish(adapter(1), version=1).ok
assert pub.publish(adapter(2), version=2).ok
print("END", flush=True)
"""


def test_an_exit_hook_registered_before_lorasync_publishes_and_closes(tmp_path):
    # Outside attack on 4219de7: once lorasync's exit hook had run, every call started later hung
    # (its future never ran), so a trainer's earlier-registered hook "publish the last step, close"
    # held the process for ever. Only a background phase's calls are refused at the exit now, and
    # a publish at the exit runs its retirement before it returns.
    proc = subprocess.run(
        [sys.executable, "-c", _HOOK_BEFORE_IMPORT, str(tmp_path)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=BOUND_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "FINAL True loaded" in proc.stdout, (proc.stdout, proc.stderr[-2000:])
    # As at any other time (keep=1): only v3 stays, with its files. A second attack found v1 and
    # v2 still loaded with their files: the publish's retirement was a background phase, refused.
    assert "CLOSED ['p@v3'] ['v3']" in proc.stdout, (proc.stdout, proc.stderr[-2000:])


_ASYNC_HOOK_BEFORE_IMPORT = r"""
import atexit, asyncio, sys, tempfile
state = {}
def hook():
    pub = state["pub"]
    async def go():
        r = await pub.apublish(adapter(3), version=3)
        print("FINAL", r.ok, r.results[0].status, flush=True)
        await pub.aclose()
        print("CLOSED", flush=True)
    try:
        asyncio.run(go())
    except BaseException as e:
        print("RAISED", type(e).__module__, type(e).__name__, e, flush=True)
    print("LOADED", sorted(state["engine"].list_adapters()), flush=True)
atexit.register(hook)  # registered before lorasync is imported: runs after its exit hook
from lorasync import Publisher
from lorasync.testing import MemoryEngine
from tests.support.adapters import tiny_adapter as adapter
state["engine"] = MemoryEngine()
pub = Publisher([state["engine"]], name="p", keep=1, root=sys.argv[2], grace=0.0, transport=sys.argv[1])
state["pub"] = pub
async def main():
    assert (await pub.apublish(adapter(1), version=1)).ok
    r = await pub.apublish(adapter(2), version=2)
    assert r.ok
    await r.asettled()
asyncio.run(main())
print("END", flush=True)
"""


@pytest.mark.parametrize("transport", ["ipc", "auto"])
def test_an_async_exit_hook_registered_before_lorasync_publishes_and_closes(tmp_path, transport):
    # Outside attack on 1bdbd97: on the caller's own loop lorasync used asyncio.to_thread, whose
    # pool Python refuses once the interpreter exits: apublish (ipc) or aclose() (auto) raised an
    # untyped RuntimeError ("cannot schedule new futures after interpreter shutdown").
    proc = subprocess.run(
        [sys.executable, "-c", _ASYNC_HOOK_BEFORE_IMPORT, transport, str(tmp_path)], cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=BOUND_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "FINAL True loaded" in proc.stdout and "CLOSED" in proc.stdout and "RAISED" not in proc.stdout, proc.stdout
    assert "LOADED ['p@v3']" in proc.stdout, proc.stdout


# -- item 18: a publisher nobody closed is closed when it is collected -------------------------------


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads(before: set[threading.Thread]) -> list[str]:
    deadline = time.monotonic() + 10.0  # idle I/O threads end by themselves within a second
    while True:
        left = sorted(t.name for t in threading.enumerate() if t not in before and t.is_alive())
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def collect_holding_the_store_lock() -> None:
    """``gc.collect()`` in a thread that holds the store's lock, as a publisher's loop thread in a
    sweep does when an allocation there sets the collector off; fails if it does not return."""
    from lorasync.transports._owned import GUARD

    def run() -> None:
        with GUARD:
            gc.collect()

    thread = threading.Thread(target=run, name="collector", daemon=True)
    thread.start()
    thread.join(20.0)
    assert not thread.is_alive(), "a finalizer waited for the store lock its own thread holds"


@pytest.mark.parametrize("closed", [False, True], ids=["dropped", "closed"])
def test_a_publisher_collected_inside_a_store_sweep_lets_go_without_waiting(tmp_path, closed):
    # CI of 2026-12-06 held one worker for 63 min: the collector ran a dropped publisher's
    # finalizer in another publisher's loop thread in the middle of a store sweep, and its
    # store.close() took the store's lock that thread already held (closed publishers too: their
    # finalizer stayed armed). A finalizer now never waits, and a closed publisher's is disarmed.
    gc.collect()
    before = set(threading.enumerate())
    pub = Publisher([MemoryEngine()], name="p", keep=1, root=tmp_path)
    pub.publish(adapter(1), version=1).settled(timeout=BOUND_S)
    run = pub.store.run
    if closed:
        pub.close()
    cycle: list[Any] = [pub]
    cycle.append(cycle)  # only the collector frees it, wherever it runs
    del pub, cycle
    collect_holding_the_store_lock()
    assert _threads(before) == []
    # Its run is free at once: a new publisher of this process takes it over.
    with Publisher([MemoryEngine()], name="p", keep=1, root=tmp_path, run=run) as again:
        assert again.publish(adapter(2), version=2).ok


def test_publishers_dropped_without_close_give_back_their_threads_and_descriptors(tmp_path):
    # 090ffbd: five publishers dropped without close() left five lorasync-publisher threads (and
    # their event loops' descriptors) alive: nothing closed a collected publisher.
    def five(close: bool, root: Path) -> None:
        for _ in range(5):
            pub = Publisher([MemoryEngine()], name="p", keep=1, root=root)
            pub.publish(adapter(1), version=1).settled(timeout=BOUND_S)
            if close:
                pub.close()
            del pub

    gc.collect()  # what earlier tests left for the collector is not counted here
    before = set(threading.enumerate())
    fds = _fds()
    five(True, tmp_path / "closed")
    gc.collect()
    assert _threads(before) == []
    closed_fds = _fds() - fds  # what closed publishers keep by design (each fresh run's lock)
    fds = _fds()
    five(False, tmp_path / "dropped")
    gc.collect()
    assert _threads(before) == []
    assert _fds() - fds == closed_fds
    # Their runs are free again: a new publisher of this process may take one over.
    run = next(p.name for p in (tmp_path / "dropped" / "p").iterdir())
    with Publisher([MemoryEngine()], name="p", keep=1, root=tmp_path / "dropped", run=run) as pub:
        assert pub.publish(adapter(2), version=2).ok
