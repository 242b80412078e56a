"""What follows a publish once the new version serves: each engine re-lists what it serves
(:meth:`EngineHandle.settle`), retires what left the retention window, and the run's files that
nothing may read again are collected.

With ``Retention.background`` (the default) this runs after ``publish`` returned, off the
critical path (write, load, verify); :class:`lorasync._loop.Background` holds it, and the next
publish, ``collect`` and ``close`` wait for it before touching any ledger, so it never races them.
What it finds is still reported: in the publish's :class:`EngineResult` (``retired``,
``deferred``, and a ``failed`` status with the error when the engine lost or superseded the new
version), complete once ``report.settled()`` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

from lorasync._files import VersionFiles
from lorasync._handle import EngineHandle
from lorasync._loop import Background
from lorasync._names import served_name
from lorasync._report import EngineResult
from lorasync._retention import Ledger, Retention
from lorasync.engines._engine import Engine
from lorasync.errors import EngineError, LoraSyncError
from lorasync.transports._transport import Transport

__all__ = ["SETTLE_WAIT_S", "Aftercare"]

#: How long a publish waits for the previous one's background phase before cancelling it and
#: redoing the retirement itself (a stuck engine call must not hold every later publish).
SETTLE_WAIT_S = 5.0


class Aftercare:
    """The publisher's part that settles, retires and collects (see the module docstring).

    Args:
        name (`str`): the adapter name.
        engines: the publisher's engines, with their ``ledgers`` and ``handles`` (by ``id``).
        files (`VersionFiles`): the run's files.
        retention (`Retention`): the policy.
        pins: the pinned versions now.
        in_place (`bool`): the publisher serves in place (no versions to retire).
    """

    def __init__(
        self,
        *,
        name: str,
        engines: Sequence[Engine],
        ledgers: dict[int, Ledger],
        handles: dict[int, EngineHandle],
        files: VersionFiles,
        retention: Retention,
        pins: Callable[[], frozenset[int]],
        in_place: bool,
    ) -> None:
        self.name = name
        self.engines = engines
        self._ledgers = ledgers
        self._handles = handles
        self._files = files
        self.retention = retention
        self.pins = pins
        self.in_place = in_place
        self.background = Background()

    async def retire_all(self, *, closing: bool = False, resync: bool = False) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"retired": [], "deferred": []}
        for engine in self.engines if not self.in_place else ():
            ledger, handle = self._ledgers[id(engine)], self._handles[id(engine)]
            with contextlib.suppress(LoraSyncError):
                if resync:
                    await handle.sync(ledger)
                if ledger.synced:
                    done, waiting = await handle.retire(ledger, self.retention, self.pins(), closing=closing)
                    out["retired"] += done
                    out["deferred"] += waiting
        newest = max((v for ledger in self._ledgers.values() for v in ledger.versions), default=None)
        if newest is not None:
            await self.collect_files(newest)
        return out

    async def after(self, done: list[tuple[EngineResult, Transport | None]], version: int, timings: dict[str, float]) -> None:
        """After a publish served: every engine re-lists what it serves and retires what left the
        window (concurrently), then the run's files nothing may read again go."""

        async def one(engine: Engine, result: EngineResult, transport: Transport) -> None:
            handle, ledger = self._handles[id(engine)], self._ledgers[id(engine)]
            t0 = time.perf_counter()
            try:
                await handle.settle(ledger, transport, version, self.retention, self.pins())
                retired, result.deferred = await handle.retire(ledger, self.retention, self.pins())
                result.retired += retired
            except Exception as exc:
                self.failed(engine, result, exc, version)
            result.timings["retire"] = time.perf_counter() - t0

        await asyncio.gather(*(one(e, r, t) for e, (r, t) in zip(self.engines, done) if t is not None))
        t0 = time.perf_counter()
        await self.collect_files(version)
        timings["gc"] = time.perf_counter() - t0

    async def previous_settled(self) -> None:
        """Wait for the last publish's background phase; redo it here if it did not finish: its
        loop dropped it (``asyncio.run`` per step cancels it on the way out), or it was stuck
        past ``SETTLE_WAIT_S`` and was cancelled."""
        if not await self.background.wait(timeout=SETTLE_WAIT_S):
            for ledger in self._ledgers.values():  # stopped half-way: ask the engines again
                ledger.synced = False
            await self.retire_all(resync=True)

    def failed(self, engine: Engine, result: EngineResult, exc: Exception, version: int) -> None:
        """Report ``exc`` as this engine's typed error; ask for its capabilities again next time (it may have restarted)."""
        if isinstance(exc, LoraSyncError):
            result.error = exc
        else:  # a bug or an untranslated foreign error: report it, typed
            where = f"{result.engine} at {engine.url or '(in-process)'}"
            result.error = EngineError(f"{where} failed unexpectedly: {type(exc).__name__}: {exc}", engine=result.engine, url=engine.url, adapter=served_name(self.name, version))
            result.error.__cause__ = exc
        result.status = "failed"
        self._handles[id(engine)].forget_caps()
        self._ledgers[id(engine)].synced = False

    def engine_lists(self) -> dict[str, set[str]]:
        ids = {id(e): self._handles[id(e)].engine_id for e in self.engines}
        return {ids[k]: {served_name(self.name, v) for v in ledger.versions} for k, ledger in self._ledgers.items() if ledger.synced}

    async def collect_files(self, current: int) -> None:
        """Delete this run's version directories nothing may read again (best effort)."""
        if self.in_place:
            swapped = {ledger.in_place[0] for ledger in self._ledgers.values() if ledger.in_place is not None}
            await self._files.collect(current=current, keep=self.retention.keep, held=swapped, pins=self.pins(), in_use=())
            return
        if any(not ledger.synced for ledger in self._ledgers.values()):
            return  # an engine's view is unknown (it failed): keep every file
        loaded = self._files.held() | {v for ledger in self._ledgers.values() for v in ledger.versions}
        in_use: set[str] | None = set()
        for handle in self._handles.values():
            if handle.reloads:  # the engines that may re-read a version's files
                busy = handle.last_in_use
                in_use = None if busy is None or in_use is None else in_use | busy
        await self._files.collect(current=current, keep=self.retention.keep, held=loaded, pins=self.pins(), in_use=in_use)
