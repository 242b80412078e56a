"""A publish cancelled while its version is being written to disk (CI failure of 2026-12-06).

A cancel stops the awaiting, never the write in its thread. Before: the write of the cancelled
publish ran on, and its ``.tmp-v<N>-<hex>`` folder was still there after the next publish (on a
loaded CI box, where ``asyncio.wait_for(..., 0.5)`` fired mid-write), then became a version folder
that no publish had recorded, even after ``close()``. Now the abandoned write removes what it wrote
when it ends, and the next write and ``close`` wait for it (bounded).

Real PEFT engine and real store; only the store's write of the cancelled version is held.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lorasync import Publisher
from lorasync.testing import make_tiny_model, tiny_llama_adapter
from lorasync.transports import disk as disk_module
from tests.reliability._trust import same, served_lora
from tests.reliability.test_trust_lifecycle import bounded


def _publisher(root: Path) -> tuple[Publisher, Any]:
    from lorasync.engines.peft import PeftEngine

    engine = PeftEngine(make_tiny_model(seed=0))
    return Publisher([engine], name="p", keep=2, transport="disk", root=root, grace=0.0), engine


def _adapter(version: int) -> Any:
    return tiny_llama_adapter(seed=version)


class _HeldWrite:
    """Holds the store's write of ``version`` until released (``on_end`` runs in the writing
    thread once the real write returned)."""

    def __init__(self, pub: Publisher, version: int, on_end: Any = None) -> None:
        self.started, self.release, self.ended = threading.Event(), threading.Event(), threading.Event()
        real = pub.store.write_hashed

        def write_hashed(adapter: Any, name: str, v: int, **kw: Any) -> Any:
            if v != version or self.started.is_set():
                return real(adapter, name, v, **kw)  # only the first write of the version is held
            self.started.set()
            self.release.wait(30)
            try:
                return real(adapter, name, v, **kw)
            finally:
                if on_end is not None:
                    on_end()
                self.ended.set()

        pub.store.write_hashed = write_hashed  # type: ignore[method-assign]


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.startswith((".tmp-", ".trash-")))


def _versions(pub: Publisher) -> list[int]:
    return sorted(pub.store.versions("p"))


async def _cancel_mid_write(pub: Publisher, held: _HeldWrite, version: int) -> None:
    task = asyncio.ensure_future(pub.apublish(_adapter(version), version=version))
    while not held.started.is_set():
        assert not task.done(), task
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _cancel_v2_then(pub: Publisher, held: _HeldWrite, adapter: Any, version: int) -> Any:
    """v1 served; v2's publish cancelled mid-write, the write ending a moment after (as a slow
    disk's would); then ``adapter`` published as ``version`` and settled. Its report."""
    await (await pub.apublish(_adapter(1), version=1)).asettled()
    await _cancel_mid_write(pub, held, 2)
    threading.Timer(0.3, held.release.set).start()
    report = await asyncio.wait_for(pub.apublish(adapter, version=version), disk_module.ABANDONED_WRITE_WAIT_S + 10)
    await report.asettled()
    return report


def test_the_next_publish_waits_for_the_cancelled_write_which_leaves_nothing(tmp_path):
    pub, engine = _publisher(tmp_path)
    held = _HeldWrite(pub, 2)
    report = bounded(asyncio.run, _cancel_v2_then(pub, held, _adapter(3), 3), what="the publish after a cancelled write")
    assert report.ok, report
    assert held.ended.is_set()
    assert _leftovers(tmp_path) == []
    assert 2 not in _versions(pub) and 3 in _versions(pub)
    assert "p@v2" not in engine.list_adapters()
    assert same(served_lora(engine, "p@v3"), dict(_adapter(3).tensors))
    pub.close()


def test_a_cancel_that_lands_after_the_write_ended_removes_the_version_it_never_read(tmp_path):
    # The write returned, but the cancel reached the publish before its answer did: the version
    # on disk was handed to nobody, so the cancelled publish removes it itself.
    pub, engine = _publisher(tmp_path)
    box: dict[str, Any] = {}

    def cancel_before_the_answer() -> None:
        if "cancelled" in box:
            return  # the publish of v2 again, below
        box["cancelled"] = True
        loop, task = box["loop"], box["task"]

        def cancel_and_block() -> None:
            task.cancel()
            time.sleep(0.3)  # the loop is held: the answer is set before the task sees the cancel

        loop.call_soon_threadsafe(cancel_and_block)
        time.sleep(0.1)

    held = _HeldWrite(pub, 2, on_end=cancel_before_the_answer)
    held.release.set()

    async def trainer() -> None:
        await (await pub.apublish(_adapter(1), version=1)).asettled()
        box["loop"] = asyncio.get_running_loop()
        box["task"] = asyncio.ensure_future(pub.apublish(_adapter(2), version=2))
        with pytest.raises(asyncio.CancelledError):
            await box["task"]

    bounded(asyncio.run, trainer(), what="the cancelled publish")
    assert held.ended.is_set()
    assert "p@v2" not in engine.list_adapters()
    # The retry, with tensors that moved on: the cancelled write's v2 was taken out first (by a
    # thread of its own, or by this write), so the new content is what serves, not a clash.
    report = pub.publish(_adapter(23), version=2)
    assert report.ok, report
    assert same(served_lora(engine, "p@v2"), dict(_adapter(23).tensors))
    assert pub.store.content_hash("p", 2) == report.content_hash
    assert _leftovers(tmp_path) == [] and _versions(pub) == [1, 2]
    pub.close()


def test_close_waits_for_a_cancelled_write(tmp_path):
    pub, _ = _publisher(tmp_path)
    held = _HeldWrite(pub, 2)

    async def trainer() -> None:
        await (await pub.apublish(_adapter(1), version=1)).asettled()
        await _cancel_mid_write(pub, held, 2)
        threading.Timer(0.3, held.release.set).start()
        await pub.aclose()

    bounded(asyncio.run, trainer(), what="close after a cancelled write")
    assert held.ended.is_set()
    assert _leftovers(tmp_path) == []
    run = next(tmp_path.glob("p/run-*"))
    assert not (run / "v2").exists()


def test_a_write_that_outlasts_the_bound_does_not_hold_the_next_publish_and_still_cleans_up(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_module, "ABANDONED_WRITE_WAIT_S", 0.3)
    pub, engine = _publisher(tmp_path)
    held = _HeldWrite(pub, 2)

    async def trainer() -> tuple[Any, float]:
        await (await pub.apublish(_adapter(1), version=1)).asettled()
        await _cancel_mid_write(pub, held, 2)
        t0 = time.monotonic()
        report = await asyncio.wait_for(pub.apublish(_adapter(3), version=3), 10)
        return report, time.monotonic() - t0

    report, waited = bounded(asyncio.run, trainer(), what="the publish after a stuck write")
    assert report.ok and waited < 5, (report, waited)
    assert same(served_lora(engine, "p@v3"), dict(_adapter(3).tensors))
    held.release.set()
    assert held.ended.wait(10)
    deadline = time.monotonic() + 10
    while (_leftovers(tmp_path) or 2 in _versions(pub)) and time.monotonic() < deadline:
        time.sleep(0.02)  # the abandoned write removes v2 in its own thread, just after it ended
    assert _leftovers(tmp_path) == [] and 2 not in _versions(pub)
    pub.close()


def test_a_cancelled_rewrite_of_an_existing_version_keeps_it(tmp_path):
    # A write of a version that exists with the same content writes nothing (a fan-out's second
    # engine, a restore); cancelled mid-way, it must not take away the version that serves.
    pub, engine = _publisher(tmp_path)
    pub.publish(_adapter(1), version=1).settled()
    held = _HeldWrite(pub, 1)
    transport = disk_module.DiskTransport(pub.store)

    async def rewrite() -> None:
        task = asyncio.ensure_future(transport.stage(_adapter(1), "p", 1))
        while not held.started.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        held.release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await transport.settle()

    bounded(asyncio.run, rewrite(), what="a cancelled rewrite")
    assert held.ended.is_set()
    assert _versions(pub) == [1] and _leftovers(tmp_path) == []
    report = pub.publish(_adapter(2), version=2)
    assert report.ok, report
    assert same(served_lora(engine, "p@v1"), dict(_adapter(1).tensors))
    pub.close()


def test_the_same_version_again_after_a_cancelled_write_serves_the_new_content(tmp_path):
    # The trainer retries the step it cancelled, with tensors that moved on meanwhile: the
    # abandoned write's v2 goes first, so the retry is no clash with it.
    pub, engine = _publisher(tmp_path)
    held = _HeldWrite(pub, 2)
    report = bounded(asyncio.run, _cancel_v2_then(pub, held, _adapter(22), 2), what="the retry of a cancelled version")
    assert report.ok, report
    assert same(served_lora(engine, "p@v2"), dict(_adapter(22).tensors))
    assert pub.store.content_hash("p", 2) == report.content_hash
    pub.close()


def test_a_retry_past_the_bound_waits_for_the_late_write_of_its_version(tmp_path, monkeypatch):
    # The cancelled write has put v2 in place but not returned yet when the retry of the same
    # version comes, past the bound: the retry's write waits for that one (in its thread, never
    # on the event loop), which takes its v2 out again; the retry then writes v2, which serves
    # with its files. (Before: the retry adopted the late write's v2, which that write then
    # removed under the engine.)
    monkeypatch.setattr(disk_module, "ABANDONED_WRITE_WAIT_S", 0.2)
    pub, engine = _publisher(tmp_path)
    wrote, finish = threading.Event(), threading.Event()

    def late_end() -> None:
        wrote.set()
        finish.wait(30)

    held = _HeldWrite(pub, 2, on_end=late_end)
    real = type(pub.store).write_hashed.__get__(pub.store)

    async def trainer() -> Any:
        await (await pub.apublish(_adapter(1), version=1)).asettled()
        await _cancel_mid_write(pub, held, 2)
        held.release.set()
        assert await asyncio.to_thread(wrote.wait, 10)  # v2 is in place; its write has not returned
        pub.store.write_hashed = real  # type: ignore[method-assign]  # the retry writes at once
        threading.Timer(1.0, finish.set).start()  # the late write ends while the retry waits for it
        report = await asyncio.wait_for(pub.apublish(_adapter(2), version=2), 20)
        assert held.ended.is_set()
        await report.asettled()
        return report

    report = bounded(asyncio.run, trainer(), what="a retry past the bound")
    assert report.ok, report
    time.sleep(0.2)
    assert 2 in _versions(pub), "the late write of the cancelled publish removed the version that serves"
    assert same(served_lora(engine, "p@v2"), dict(_adapter(2).tensors))
    assert _leftovers(tmp_path) == []
    pub.close()
