"""Disk transport: an atomic versioned directory of the publisher's run (tmpfs by default) that the
engine loads by path.

A version is written in a thread. A cancel stops the awaiting, never the write: the write that a
cancelled publish left running is *abandoned*, and leaves nothing in the run (nobody was handed
it, so it was never loaded, served or recorded):

* a write that had not begun never begins (the pool may also drop it);
* one under way asks, right before and right after it puts the version in place, whether it is
  still wanted (``DiskStore.write_hashed(wanted=...)``), and takes it out through the run's folder
  it holds open;
* one whose answer the cancel lost is undone by a thread of its own, and by the next write of the
  same version first.

Work on one version takes that version's lock in its thread, never on the event loop, so a retry
of a cancelled version never finds, nor loses, the cancelled write's files. The next write and
the publisher's close wait for abandoned writes (at most ``ABANDONED_WRITE_WAIT_S``), so no temp
folder or unrecorded version appears in the run after the publish that follows, or after close.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from lorasync.runtime._loop import to_thread_pool, to_thread_untracked
from lorasync.transports._transport import Delivery, Transport
from lorasync.transports._store import DiskStore, WriteNotWanted

if TYPE_CHECKING:
    from lorasync.adapter._adapter import Adapter
    from lorasync.engines._engine import Capabilities, Engine

__all__ = ["ABANDONED_WRITE_WAIT_S", "DiskTransport"]

log = logging.getLogger("lorasync.publish")

#: How long the next write (and close) waits for a write that a cancelled publish left running.
#: Past that it goes on: the abandoned write still removes what it wrote when it ends.
ABANDONED_WRITE_WAIT_S = 5.0


class DiskTransport(Transport):
    """Write ``<root>/<name>/<run>/v<version>`` once, then ``engine.load_adapter(served, path)``.

    Args:
        store (`DiskStore`): where versions live; engines must see the same paths.
    """

    name = "disk"

    def __init__(self, store: DiskStore) -> None:
        self.store = store
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        # What this publish already wrote: engines 2..N of a fan-out load the same directory
        # without hashing the adapter again (the publisher clears it at each publish). The bytes
        # and seconds of the write are reported once, by the first delivery that uses it.
        self._written: dict[tuple[str, int], _Written] = {}
        self._abandoned: list[_Job] = []  # writes (and undos) of cancelled publishes that may still run

    def new_publish(self) -> None:
        """Forget what earlier publishes wrote (their tensors may have changed in place since)."""
        self._written.clear()
        # One lock per version ever written would grow with every step: keep those in use.
        self._locks = {key: lock for key, lock in self._locks.items() if lock.locked()}

    def unsupported(self, caps: Capabilities) -> str | None:
        if not caps.lora or not caps.runtime_lora:
            return "engine cannot load LoRA adapters at runtime"
        if not caps.same_host:
            return "engine does not share this host's filesystem (use a shared root or transport='ipc'/'merged')"
        return None

    async def stage(self, adapter: Adapter, name: str, version: int) -> tuple[str, bool]:
        """Write the version (once per publish) and return ``(content_hash, new)``: the hash of
        the bytes written, from the write pass itself, so the publisher needs no hashing pass of
        its own; ``new`` when this call created the directory (identical content already there:
        False)."""
        done = await self._write_once(adapter, name, version)
        return done.digest, done.new

    def discard(self, name: str, version: int) -> bool:
        """Remove a version this publish staged but no engine was handed (its content was already
        served: "unchanged"). Returns whether it was removed."""
        done = self._written.pop((name, version), None)
        if done is None or not done.new:
            return False
        self.store.remove(name, version)
        return True

    async def write(self, adapter: Adapter, name: str, version: int) -> tuple[str, int, float]:
        """Write the version once for all engines of a publish; ``(path, bytes, seconds)``."""
        start = time.perf_counter()
        done = await self._write_once(adapter, name, version)
        if done.unreported:
            done.unreported = False
            return done.path, done.nbytes, done.seconds
        return done.path, 0, time.perf_counter() - start

    async def settle(self) -> None:
        """Wait for the writes cancelled publishes left running (at most
        ``ABANDONED_WRITE_WAIT_S``, once per write: one stuck past it is not waited for again);
        none of them leaves anything in the run."""
        running = self._to_wait()
        if running:
            await asyncio.wait([asyncio.wrap_future(f) for f in running], timeout=ABANDONED_WRITE_WAIT_S)
        self._waited()

    def settle_blocking(self) -> None:
        """:meth:`settle` for a caller without an event loop (the publisher's sync ``close``)."""
        running = self._to_wait()
        if running:
            concurrent.futures.wait(running, timeout=ABANDONED_WRITE_WAIT_S)
        self._waited()

    def _to_wait(self) -> list[concurrent.futures.Future[None]]:
        return [job.ended for job in self._abandoned if not job.ended.done() and not job.waited]

    def _waited(self) -> None:
        for job in self._abandoned:
            job.waited = True  # still running past the bound: its version's lock orders the rest
        self._abandoned = [job for job in self._abandoned if not job.ended.done()]

    async def _write_once(self, adapter: Adapter, name: str, version: int) -> _Written:
        lock = self._locks.setdefault((name, version), asyncio.Lock())
        async with lock:
            done = self._written.get((name, version))
            if done is not None and done.adapter is adapter:
                return done
            await self.settle()
            start = time.perf_counter()
            job = _Job(self._slot(name, version))
            try:  # a daemon thread (a stuck disk never holds asyncio.run's exit), no engine's call
                path, written, digest = await to_thread_untracked(self._write_job, job, adapter, name, version)
            except asyncio.CancelledError:
                self._abandon(job, name, version)
                raise
            done = _Written(adapter, str(path), digest, written, time.perf_counter() - start, new=written > 0)
            self._written[(name, version)] = done
            return done

    def _slot(self, name: str, version: int) -> _Slot:
        # One per version of the run in this process, whatever transport writes it: the function
        # API makes a publisher (and transport) per call on one shared run.
        key = (str(self.store.root), self.store.run, name, version)
        with _SLOTS_GUARD:
            slot = _SLOTS.get(key)
            if slot is None:
                slot = _SLOTS[key] = _Slot()
            return slot

    def _write_job(self, job: _Job, adapter: Adapter, name: str, version: int) -> tuple[object, int, str] | None:
        """The write, in its thread, holding its version's slot (a write of the same version waits
        for it; the event loop never does). Wanted only while its publish awaits it."""
        try:
            with job.flags:
                if job.abandoned:
                    return None  # cancelled before it began: nothing to write
                job.started = True
            with job.slot.lock:
                self._undo_at(job.slot, name, version)  # a cancelled write's version goes before anything reads it
                if job.abandoned:
                    return None  # cancelled while it waited for another write of this version
                try:
                    out = self.store.write_hashed(adapter, name, version, wanted=lambda: not job.abandoned)
                except WriteNotWanted:
                    return None
                with job.flags:
                    if not job.abandoned:
                        job.result = out
                        return out
                if out[1]:  # cancelled after its last check: what it put in place goes again
                    with job.slot.flags:
                        job.slot.undo = True
                    self._undo_at(job.slot, name, version)
                return None
        finally:
            with job.flags:
                if not job.ended.done():
                    job.ended.set_result(None)

    def _abandon(self, job: _Job, name: str, version: int) -> None:
        """A cancelled caller lets go of its write: a write that has not begun never will, one
        under way leaves nothing (``wanted``), and one whose answer was lost here is undone by a
        thread before anything reads that version (the version's next write does it first)."""
        with job.flags:  # never held across file work: the loop only flips flags here
            job.abandoned = True
            lost = job.result
            if not job.started and not job.ended.done():
                job.ended.set_result(None)  # the pool may drop a call cancelled before it ran
        if lost is not None and lost[1]:
            self._schedule_undo(job.slot, name, version)
        elif not job.ended.done():
            self._abandoned.append(job)

    @contextlib.asynccontextmanager
    async def cancel_guard(self, name: str, version: int, *, recorded: Callable[[], bool]) -> AsyncIterator[None]:
        """Around one publish of ``version``: cancelled after its write, while ``recorded()`` says
        no engine recorded the version, the files it wrote go (:meth:`drop_cancelled`): a retry of
        the version with the trainer's newer tensors would clash with them. An engine that loaded
        it unrecorded unloads it at the next publish (its handle's ``cancelled``)."""
        try:
            yield
        except asyncio.CancelledError:
            if not recorded():
                self.drop_cancelled(name, version)
            raise

    def drop_cancelled(self, name: str, version: int) -> None:
        """The publish that wrote ``version`` (new) was cancelled before any engine recorded it:
        its files go, by a thread, before any later write of the version reads the run."""
        done = self._written.pop((name, version), None)
        if done is None or not done.new:
            return
        self._schedule_undo(self._slot(name, version), name, version)

    def _schedule_undo(self, slot: _Slot, name: str, version: int) -> None:
        """Mark the version for removal and start a thread that removes it (the next write of
        the version does it first if that comes sooner); settles wait for it."""
        with slot.flags:
            slot.undo = True
        undo = _Job(slot, started=True)
        self._abandoned.append(undo)
        to_thread_pool(self._undo_job, undo, name, version)

    def _undo_job(self, job: _Job, name: str, version: int) -> None:
        try:
            with job.slot.lock:
                self._undo_at(job.slot, name, version)
        finally:
            job.ended.set_result(None)

    def _undo_at(self, slot: _Slot, name: str, version: int) -> None:
        """Remove the version a cancelled publish wrote but never read, if still to do (the
        caller holds ``slot.lock``)."""
        with slot.flags:
            if not slot.undo:
                return
            slot.undo = False
        if self.store.closed:
            log.warning("%s v%d, written by a publish that was cancelled, stays: its publisher closed first", name, version)
            return
        try:
            self.store.remove(name, version)
        except Exception as exc:  # noqa: BLE001 - nothing was handed this version; the run's sweep collects it
            log.warning("could not remove %s v%d, written by a publish that was cancelled: %s", name, version, exc)

    async def deliver(self, adapter: Adapter, engine: Engine, caps: Capabilities, *, name: str, version: int, served: str) -> Delivery:
        # The version's directory belongs to this publisher's run: no other publisher collects it.
        path, written, write_s = await self.write(adapter, name, version)
        start = time.perf_counter()
        await engine.aload_adapter(served, path)
        load_s = time.perf_counter() - start
        size = sum(f.lstat().st_size for f in self.store.path_for(name, version).iterdir())
        return Delivery(served_name=served, bytes_moved=size, timings={"write": write_s, "load": load_s})


class _Slot:
    """One version of a run in this process: ``lock`` is held by a thread over a write or an undo
    of it (never by the event loop); ``undo`` (under ``flags``): a cancelled publish's write put it
    in place and nobody will read it, so it is removed before anything else touches it. Kept alive
    by the jobs that use it (a weak registry: no entry per version ever written)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.flags = threading.Lock()
        self.undo = False


_SLOTS: weakref.WeakValueDictionary[tuple[str, str, str, int], _Slot] = weakref.WeakValueDictionary()
_SLOTS_GUARD = threading.Lock()


class _Job:
    """One write in its thread; ``abandoned``, ``started`` and ``result`` are read and set under
    ``flags``, which is never held across file work."""

    def __init__(self, slot: _Slot, *, started: bool = False) -> None:
        self.slot = slot
        self.flags = threading.Lock()
        self.abandoned = False
        self.started = started
        self.result: tuple[object, int, str] | None = None
        self.ended: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.waited = False  # a settle already gave it its bounded wait


@dataclass
class _Written:
    adapter: Adapter
    path: str
    digest: str
    nbytes: int
    seconds: float
    new: bool
    unreported: bool = True
