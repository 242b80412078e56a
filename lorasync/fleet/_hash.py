"""A Fleet round's unchanged check: the content hash of every adapter passed, computed in worker
threads, each changed tenant handed to the round as soon as its hash says so.

The check stays content-based: every byte of every adapter passed is hashed every round. Object
identity and torch version counters are never taken as proof that nothing changed (``.data``
writes and fused optimizer kernels bypass the counters, and a no-copy export *is* the trainer's
memory, changed in place after it was exported).

Own code, for speed (``lorasync bench fleet``): a round with one changed tenant out of 16 spends
most of its time hashing the 15 that did not change.

* :func:`content_hash` is :attr:`Adapter.content_hash`, which reads plain host tensors in place
  (:mod:`lorasync.adapter._memory`: a ``ctypes`` view per tensor instead of three torch calls and
  a numpy view, header bytes kept across rounds). For a Qwen3-0.6B r16 adapter (392 tensors,
  20 MB) that is about 1.7 ms against 3.2-4.9 ms before, on the shared 2-core box of
  docs/benchmarks.md, where the xxh3 passes alone take 0.9-1.2 ms.
* ``xxhash`` releases the GIL while it hashes a buffer, so :func:`scan` hashes tenants in a few
  threads at once; memory bandwidth, not the GIL, then bounds it.
* Where an engine takes tensors, the hash and the owned copy a round publishes are read under
  the publish's own torn-read watch (:class:`~lorasync.publisher._digest.PublishDigest`, begun before the
  first read and handed to the tenant's publish): a step of the trainer's optimizer meanwhile is
  an ``AdapterChangedError`` for that tenant, as for a plain ``Publisher``, never a mix served.
  Where the engine loads files, the check reads under no watch: an equal hash means every byte
  read was the serving version's, and a changed tenant's publish hashes again under its own.
* :func:`scan` wakes the round's loop once per changed or failed tenant, not once per tenant, so
  the round can start a changed tenant's publish while the others are still hashed.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lorasync.adapter._adapter import Adapter
from lorasync.publisher._digest import PublishDigest, refuse_freed

__all__ = ["Gate", "HashJob", "content_hash", "scan"]

#: Hashing threads per round: more than the cores only adds contention, and past a few the
#: memory bus is the limit.
WORKERS = max(1, min(4, os.cpu_count() or 1))


def content_hash(adapter: Adapter) -> str:
    """:attr:`Adapter.content_hash` (host tensors are read in place: :mod:`lorasync.adapter._memory`)."""
    return adapter.content_hash


@dataclass(frozen=True)
class HashJob:
    """One tenant's adapter to check.

    Attributes:
        name: the tenant.
        adapter: what the trainer passed (an ``Adapter``, or a PEFT model / state dict to export).
        current: the content hash of the tenant's current version (None: it has none).
        copy: a changed adapter is copied (an owned copy, hashed again), because an engine takes
            the tensors themselves and a restore must load the version from lorasync's own copy.
    """

    name: str
    adapter: Any
    current: str | None
    copy: bool


# on_changed(name, adapter, digest, error): the adapter of a changed tenant and the digest its
# publish goes on with (None: the publish takes its own), or error.
Changed = Callable[[str, "Adapter | None", "PublishDigest | None", "BaseException | None"], None]


class Gate:
    """Holds :func:`scan`'s workers (between two tenants) while a changed tenant's publish reads
    its adapter. Hashing threads beside that pass share the GIL and the memory bus with it: the
    write of a 20 MB, 392-tensor version took ~14 ms alone and ~200 ms beside two hashing threads
    (each of its hundreds of GIL hand-backs waited out a switch interval). The engine's part of the
    publish (the load) leaves the host idle, and the scan resumes then.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = 0
        self._open = False  # for good: the round ended or was cancelled

    def hold(self) -> None:
        with self._cond:
            self._held += 1

    def release(self) -> None:
        with self._cond:
            self._held = max(0, self._held - 1)
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def wait(self) -> None:
        with self._cond:
            while self._held and not self._open:
                self._cond.wait()


async def scan(jobs: Sequence[HashJob], on_changed: Changed, *, gate: Gate | None = None, workers: int = WORKERS) -> list[str]:
    """Hash every job's adapter in up to ``workers`` threads; call ``on_changed`` on the running
    loop for each tenant whose content differs from ``current`` (or whose export or hash raised),
    as soon as that is known.

    Args:
        gate: held by a worker for every changed tenant before ``on_changed`` is called (the
            caller releases it once per changed tenant); workers wait for it between tenants.

    Returns:
        The names whose content equals their current version's, in ``jobs`` order. Every
        ``on_changed`` call has run when this returns.
    """
    if not jobs:
        return []
    loop = asyncio.get_running_loop()
    left = iter(jobs)
    take = threading.Lock()
    same: set[str] = set()
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            with take:
                job = next(left, None)
            if job is None:
                return  # before the gate: a worker with nothing left waits for nobody
            if gate is not None:
                gate.wait()
            if stop.is_set():
                return
            try:
                adapter, digest = _check(job)
            except BaseException as exc:  # noqa: BLE001 - this tenant's; the round decides
                loop.call_soon_threadsafe(on_changed, job.name, None, None, exc)
                continue
            if adapter is None:
                same.add(job.name)
                continue
            if gate is not None:
                gate.hold()
            loop.call_soon_threadsafe(on_changed, job.name, adapter, digest, None)

    def run(done: asyncio.Future[None]) -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - handed to the round
            loop.call_soon_threadsafe(_settle, done, exc)
        else:
            loop.call_soon_threadsafe(_settle, done, None)

    # Threads of their own, not the loop's executor: a worker waiting at the gate must never hold
    # the thread that the publish it waits for needs (an executor of one thread would deadlock).
    # A worker's on_changed calls are queued before its completion (one FIFO queue), so every
    # on_changed has run when the gather returns.
    finished = [loop.create_future() for _ in range(max(1, min(workers, len(jobs))))]
    for done in finished:  # each in a copy of the round's context (the caller's thread, for the watch)
        threading.Thread(target=contextvars.copy_context().run, args=(run, done), name="lorasync-fleet-hash", daemon=True).start()
    try:
        await asyncio.gather(*finished)
    except BaseException:
        stop.set()  # cancelled: the workers take no further tenant, and wait for nothing
        if gate is not None:
            gate.open()
        raise
    return [job.name for job in jobs if job.name in same]


def _settle(done: asyncio.Future[None], error: BaseException | None) -> None:
    if done.done():  # cancelled meanwhile
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


def _check(job: HashJob) -> tuple[Adapter | None, PublishDigest | None]:
    """``(None, None)`` when unchanged; else the adapter to publish and the digest its publish
    goes on with: with ``job.copy`` an owned copy and its digest, else the trainer's adapter and
    None (its publish hashes it again in the disk write pass, under a watch of its own).

    The hash and the copy are the publish's own parts (:class:`~lorasync.publisher._digest.PublishDigest`),
    taken here under its torn-read watch: an optimizer step while they read the trainer's memory
    is an ``AdapterChangedError`` for this tenant, as in a plain ``Publisher``.
    """
    adapter = job.adapter
    if not isinstance(adapter, Adapter):
        from lorasync.exporters.fsdp import export

        adapter = export(adapter)
    if not job.copy:
        refuse_freed(adapter)  # before any read of the trainer's memory (PublishDigest does it below)
        # No watch: nothing read here is served. A hash equal to the current version's means every
        # byte read was that version's (the engine goes on serving it, whole); a different one only
        # starts the publish, which reads and hashes the tensors again under its own watch. The
        # watch's version counters cost ~40 us per tenant per read, a tenth of a 16-tenant round.
        return (None, None) if content_hash(adapter) == job.current else (adapter, None)
    digest = PublishDigest(adapter)  # the watch begins before the first read of the tensors
    if digest.hash_now(content_hash) == job.current:
        return None, None
    if job.copy:
        owned = digest.copy_now()
        return owned.adapter, owned
    return adapter, None
