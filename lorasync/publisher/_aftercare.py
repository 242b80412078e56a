"""What follows a publish once the new version serves: each engine re-lists what it serves
(:meth:`EngineHandle.settle`), retires what left the retention window, and the run's files that
nothing may read again are collected.

With ``Retention.background`` (the default) this runs after ``publish`` returned, off the
critical path (write, load, verify); :class:`lorasync.runtime._loop.Background` holds it, and the next
publish, ``collect`` and ``close`` wait for it before touching any ledger, so it never races them.
What it finds is still reported: in the publish's :class:`EngineResult` (``retired``,
``deferred``, and a ``failed`` status with the error when the engine lost or superseded the new
version), complete once ``report.settled()`` returns.

Two ways a phase does not finish, and what happens then:

* Its loop dropped it (``asyncio.run`` per step cancels what is left when the step's loop ends):
  the phase runs again on the publisher's own loop thread and reports into the same report.
* It is stuck in an engine call: whoever waits for it next gives it ``SETTLE_WAIT_S``, then
  cancels it for good and never redoes it inline. What it was retiring stays loaded, with
  its files (invariant 5), is listed in that report's ``deferred`` with the reason, warned about
  (``RetentionWarning``), and is retried by the next phase, off the critical path, which reports
  it in its own ``retired``. Each retry is bounded the same way, so a stuck engine costs a
  publish at most ``SETTLE_WAIT_S``, never the length of the hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import warnings
from collections.abc import Callable, Coroutine, Generator, Sequence
from typing import Any

from lorasync.runtime._background import Background, Pending
from lorasync.publisher._files import VersionFiles
from lorasync.publisher._handle import EngineHandle
from lorasync.runtime._loop import LoopThread
from lorasync.adapter._names import served_name
from lorasync.publisher._report import EngineResult
from lorasync.publisher._retention import Ledger, Retention, RetentionWarning
from lorasync.engines._engine import Engine
from lorasync.errors import EngineError, LoraSyncError
from lorasync.transports._transport import Transport

__all__ = ["CLOSE_WAIT_S", "SETTLE_WAIT_S", "Aftercare", "Phase"]

#: How long whoever comes next (the next publish, ``collect``, ``close``) waits for a publish's
#: background phase before cancelling it for good: a stuck engine call must not hold every later
#: publish for as long as it hangs.
SETTLE_WAIT_S = 5.0

#: How long ``close`` gives its own last retirement; what it could not retire stays loaded, with
#: its files (an engine that hangs must not hang the trainer's exit).
CLOSE_WAIT_S = 10.0


class Phase:
    """One publish's background phase: awaitable once, and callable for a fresh run of it (a
    phase its loop dropped runs again elsewhere; see the module docstring)."""

    def __init__(self, care: Aftercare, done: list[tuple[EngineResult, Transport | None]], version: int, timings: dict[str, float]) -> None:
        self.care = care
        self.done = done
        self.version = version
        self.timings = timings
        self.finished: set[int] = set()  # engines (by id) whose part ended in the latest run

    def __call__(self) -> Coroutine[Any, Any, None]:
        return self.care._after(self)

    def __await__(self) -> Generator[Any, None, None]:
        return self().__await__()


class Aftercare:
    """The publisher's part that settles, retires and collects (see the module docstring).

    Args:
        name (`str`): the adapter name.
        engines: the publisher's engines, with their ``ledgers`` and ``handles`` (by ``id``).
        files (`VersionFiles`): the run's files.
        retention (`Retention`): the policy.
        pins: the pinned versions now.
        in_place (`bool`): the publisher serves in place (no versions to retire).
        rescue (`LoopThread`): where a phase its loop dropped runs again.
        guard: the publisher's blocking-call guard (for ``report.settled()``).
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
        rescue: LoopThread,
        guard: Callable[[str, str], None],
    ) -> None:
        self.name = name
        self.engines = engines
        self._ledgers = ledgers
        self._handles = handles
        self._files = files
        self.retention = retention
        self.pins = pins
        self.in_place = in_place
        self.background = Background(rescue)
        self._guard = guard
        self._phase: Phase | None = None
        self._left: dict[int, set[int]] = {}  # engine id -> versions a cancelled phase left loaded

    async def retire_all(self, *, closing: bool = False, resync: bool = False) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"retired": [], "deferred": []}
        for engine in self.engines if not self.in_place else ():
            ledger, handle = self._ledgers[id(engine)], self._handles[id(engine)]
            with contextlib.suppress(LoraSyncError):
                if resync or ledger.unverified:  # versions a failed verification left loaded go too
                    await handle.sync(ledger)
                if ledger.synced:
                    done, waiting = await handle.retire(ledger, self.retention, self.pins(), closing=closing)
                    out["retired"] += done
                    out["deferred"] += waiting
        newest = max((v for ledger in self._ledgers.values() for v in ledger.versions), default=None)
        if newest is not None:
            await self.collect_files(newest)
        return out

    def after(self, done: list[tuple[EngineResult, Transport | None]], version: int, timings: dict[str, float]) -> Phase:
        """What follows a publish that served: every engine re-lists what it serves and retires
        what left the window (concurrently), then the run's files nothing may read again go.
        Await it, or :meth:`start` it in the background."""
        return Phase(self, done, version, timings)

    def start(self, phase: Phase) -> Pending:
        """Run ``phase`` in the background on the running loop; its report waits on the result."""
        self._phase = phase
        return Pending(self.background.start(phase), self._guard)

    async def _after(self, phase: Phase) -> None:
        phase.finished = set()

        async def one(engine: Engine, result: EngineResult, transport: Transport | None) -> None:
            handle, ledger = self._handles[id(engine)], self._ledgers[id(engine)]
            t0 = time.perf_counter()
            left = self._left.pop(id(engine), set())
            try:
                if transport is not None:
                    await handle.settle(ledger, transport, phase.version, self.retention, self.pins())
                # What a cancelled phase left loaded and is gone now (its stuck call went through
                # after all) retired too: say so here, where its retry is reported.
                result.retired += [served_name(self.name, v) for v in sorted(left) if v not in ledger.versions]
                retired, result.deferred = await handle.retire(ledger, self.retention, self.pins())
                result.retired += retired
            except Exception as exc:
                self._left[id(engine)] = left | self._left.get(id(engine), set())
                self.failed(engine, result, exc, phase.version)
            result.timings["retire"] = time.perf_counter() - t0
            phase.finished.add(id(engine))

        await asyncio.gather(*(one(e, r, t) for e, (r, t) in zip(self.engines, phase.done) if t is not None or self._outgrown(e, r)))
        t0 = time.perf_counter()
        await self.collect_files(phase.version)
        phase.timings["gc"] = time.perf_counter() - t0

    def _outgrown(self, engine: Engine, result: EngineResult) -> bool:
        """An engine reported ``unchanged`` that lists versions outside the window: the version it
        serves was found loaded already (a load whose answer was lost, recognised by its files),
        beside the older ones it replaces; they retire as after a load."""
        ledger = self._ledgers[id(engine)]
        if result.status != "unchanged" or self.in_place or not ledger.synced:
            return False
        window = self.retention.window([v for v in ledger.versions if v not in ledger.unverified], self.pins())
        return any(v not in window for v in ledger.versions)

    async def previous_settled(self) -> bool:
        """Wait for the last publish's background phase, at most ``SETTLE_WAIT_S``; whether it
        finished. One that did not is cancelled for good and never redone here
        (see the module docstring): the engines it left are asked again by whoever comes next."""
        if await self.background.wait(timeout=SETTLE_WAIT_S):
            return True
        phase, self._phase = self._phase, None
        if phase is not None:
            self._left_behind(phase)
        return False

    def _left_behind(self, phase: Phase) -> None:
        """Report, in the phase's own results, what its cancellation left loaded."""
        stuck = []
        for engine, (result, transport) in zip(self.engines, phase.done):
            if transport is None or id(engine) in phase.finished:
                continue
            ledger = self._ledgers[id(engine)]
            ledger.synced = False  # stopped half-way: ask the engine again before trusting it
            window = self.retention.window(list(ledger.versions), self.pins())
            outside = sorted(v for v in ledger.versions if v not in window)
            self._left.setdefault(id(engine), set()).update(outside)
            left = [served_name(self.name, v) for v in outside]
            result.deferred = left
            result.reason += (
                f"; its retirement did not finish within {SETTLE_WAIT_S:g} s (an engine call did not return) and "
                f"was cancelled: {', '.join(left) or 'nothing'} stay loaded with their files, retried after the next publish"
            )
            stuck.append(f"{self._handles[id(engine)].where} ({', '.join(left) or 'nothing left'})")
        if stuck:
            warnings.warn(
                f"the retirement after publishing {self.name} v{phase.version} did not finish within {SETTLE_WAIT_S:g} s "
                f"on {'; '.join(stuck)}: an engine call did not return. It was cancelled; those versions stay loaded "
                "with their files and are retried after the next publish. Check the engine.",
                RetentionWarning,
                stacklevel=2,
            )

    async def close_out(self) -> dict[str, list[str]]:
        """``close``'s last retirement (the publisher's lock held): wait for the last phase, then
        retire what has drained, bounded by ``CLOSE_WAIT_S``."""
        finished = await self.previous_settled()
        try:
            return await asyncio.wait_for(self.retire_all(closing=True, resync=not finished), CLOSE_WAIT_S)
        except asyncio.TimeoutError:
            warnings.warn(
                f"closing the publisher of {self.name}: its last retirement did not finish within {CLOSE_WAIT_S:g} s "
                "(an engine call did not return); what it had not retired stays loaded, with its files",
                RetentionWarning,
                stacklevel=2,
            )
            return {"retired": [], "deferred": []}

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
