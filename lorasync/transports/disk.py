"""Disk transport: an atomic versioned directory of the publisher's run (tmpfs by default) that the
engine loads by path.

A version is written in a thread. A cancel stops the awaiting, never the write: the write that a
cancelled publish left running is *abandoned*. It removes what it wrote when it ends (nobody was
handed it, so it was never loaded, served or recorded), and the next write and the publisher's
close wait for it (at most ``ABANDONED_WRITE_WAIT_S``), so no temp directory or unrecorded version
appears in the run after the publish that follows, or after close.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lorasync.runtime._loop import to_thread_untracked
from lorasync.transports._transport import Delivery, Transport
from lorasync.transports._store import DiskStore

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
        self._abandoned: list[_Job] = []  # writes of cancelled publishes that may still run

    def new_publish(self) -> None:
        """Forget what earlier publishes wrote (their tensors may have changed in place since)."""
        self._written.clear()

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
        ``ABANDONED_WRITE_WAIT_S``); each removes what it wrote when it ends."""
        running = [asyncio.wrap_future(job.ended) for job in self._abandoned if not job.ended.done()]
        if running:
            await asyncio.wait(running, timeout=ABANDONED_WRITE_WAIT_S)
        self._abandoned = [job for job in self._abandoned if not job.ended.done()]

    async def _write_once(self, adapter: Adapter, name: str, version: int) -> _Written:
        lock = self._locks.setdefault((name, version), asyncio.Lock())
        async with lock:
            done = self._written.get((name, version))
            if done is not None and done.adapter is adapter:
                return done
            await self.settle()
            for left in self._abandoned:
                if left.key == (name, version):
                    with left.lock:  # past the wait: this write takes the version over, never undone by it
                        left.kept = True
            start = time.perf_counter()
            job = _Job((name, version))
            try:  # a daemon thread (a stuck disk never holds asyncio.run's exit), no engine's call
                path, written, digest = await to_thread_untracked(self._write_job, job, adapter, name, version)
            except asyncio.CancelledError:
                with job.lock:
                    job.abandoned = True
                    lost = job.result  # the write ended, but its answer never reached this publish
                if lost is not None:
                    self._undo(name, version, lost[1])
                elif not job.ended.done():
                    self._abandoned.append(job)
                raise
            done = _Written(adapter, str(path), digest, written, time.perf_counter() - start, new=written > 0)
            self._written[(name, version)] = done
            return done

    def _write_job(self, job: _Job, adapter: Adapter, name: str, version: int) -> tuple[object, int, str]:
        """The write, in its thread: when the publish that started it was cancelled meanwhile, it
        removes what it wrote (exactly one of this thread and the cancelled caller does)."""
        try:
            out = self.store.write_hashed(adapter, name, version)
            with job.lock:  # held over the removal: a later write of the version waits for it (kept)
                if not job.abandoned:
                    job.result = out
                    return out
                if not job.kept:
                    self._undo(name, version, out[1])
            return out
        finally:
            job.ended.set_result(None)

    def _undo(self, name: str, version: int, written: int) -> None:
        if not written:
            return  # the identical version was there before: not this write's to remove
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


@dataclass
class _Job:
    """One write in its thread; ``abandoned``, ``kept`` (a later write of the same version took it
    over: nothing is removed) and ``result`` are read and set under ``lock``."""

    key: tuple[str, int]
    lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False
    kept: bool = False
    result: tuple[object, int, str] | None = None
    ended: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


@dataclass
class _Written:
    adapter: Adapter
    path: str
    digest: str
    nbytes: int
    seconds: float
    new: bool
    unreported: bool = True
