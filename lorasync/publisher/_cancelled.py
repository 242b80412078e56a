"""What a cancelled publish left running on one engine (part of :class:`lorasync.publisher._handle.EngineHandle`).

A cancel stops the awaiting, never an engine call already running in its thread: the in-process
PEFT engine goes on loading under its own lock, which every later call of the engine takes, and
a remote engine may complete a load whose answer nobody reads. So the publish that comes next
first waits for those calls, at most ``CANCELLED_CALL_WAIT_S`` (past that it reports the engine
failed, ``EngineTimeoutError``, and changes nothing: the previous version serves on), then asks
the engine what it serves and unloads a version the cancelled publish loaded without recording
it (it was never reported served, verified or hashed: design invariants 2, 8 and 11).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lorasync.runtime._loop import BOUND_PASSED, tracked_calls
from lorasync.adapter._names import served_name
from lorasync.publisher._retention import Ledger
from lorasync.errors import EngineTimeoutError

__all__ = ["CANCELLED_CALL_WAIT_S", "CancelledCalls"]

log = logging.getLogger("lorasync.publish")

#: How long the next publish waits for the engine calls a cancelled publish left running before
#: it reports that engine failed: as long as it waits for a stuck retirement
#: (``lorasync.publisher._aftercare.SETTLE_WAIT_S``), never the length of the hang.
CANCELLED_CALL_WAIT_S = 5.0


@dataclass
class _Cancelled:
    """A publish of ``version`` cancelled with engine ``calls`` possibly still running;
    ``recorded``: the ledger held the version when it was cancelled (then it is not undone)."""

    version: int
    recorded: bool
    calls: list[concurrent.futures.Future[Any]]
    waited: bool = False  # the cancel itself waited the bound for them already

    @property
    def running(self) -> bool:
        return any(not c.done() for c in self.calls)


class CancelledCalls:
    """The cancelled publishes of one engine handle not reconciled yet.

    Args:
        handle (`EngineHandle`): the engine as its publisher sees it (its ``where``, ``name``,
            ``engine``, ``sync`` and ``unload`` are used).
    """

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._left: list[_Cancelled] = []
        self._work: list[asyncio.Future[Any]] = []  # deliveries a cancel stopped waiting for (past its bound)

    def left_running(self, work: asyncio.Future[Any]) -> None:
        """A cancel stopped waiting for ``work`` (a whole delivery, which may start more engine
        calls): the next publish waits for it as for the calls a cancel left running."""
        self._work.append(work)

    @contextlib.contextmanager
    def watch(self, ledger: Ledger, version: int) -> Iterator[None]:
        """Run one publish of ``version`` to the engine; if it is cancelled, remember the engine
        calls it left running, for :meth:`reconcile`."""
        with tracked_calls() as calls:
            try:
                yield
            except asyncio.CancelledError as exc:
                ledger.synced = False  # stopped half-way: ask the engine again before trusting it
                self._left.append(_Cancelled(version, version in ledger.versions, [c for c in calls if not c.done()], BOUND_PASSED in exc.args))
                raise

    async def reconcile(self, ledger: Ledger) -> None:
        """Before the engine is touched again: wait for what cancelled publishes left running (at
        most ``CANCELLED_CALL_WAIT_S``), then unload a version one of them loaded unrecorded.

        Raises:
            EngineTimeoutError: a cancelled call still runs; nothing was changed (retry later).
        """
        self._work = [w for w in self._work if not w.done()]
        if not self._left and not self._work:
            return
        handle = self._handle
        running = [asyncio.wrap_future(c) for left in self._left for c in left.calls if not c.done()] + self._work
        # The bound counts once: a cancel that already waited it out for these calls leaves none.
        bound = 0.05 if all(left.waited for left in self._left if left.running) else CANCELLED_CALL_WAIT_S
        if running and (await asyncio.wait(running, timeout=bound))[1]:
            versions = ", ".join(f"v{left.version}" for left in self._left if left.running or left.waited)
            raise EngineTimeoutError(
                f"{handle.where} is still busy with the cancelled load of {handle.name} {versions} after "
                f"{CANCELLED_CALL_WAIT_S:g} s; nothing was changed and the previous version still serves: retry once it finished",
                engine=handle.engine.kind,
                url=handle.engine.url,
                adapter=handle.name,
            )
        ledger.synced = False
        await handle.sync(ledger)
        stray = sorted({left.version for left in self._left if not left.recorded and left.version in ledger.versions})
        if stray:
            log.info("%s: unloading %s, loaded by a publish that was cancelled", handle.where, ", ".join(served_name(handle.name, v) for v in stray))
            await handle.unload(ledger, stray)
        self._left, self._work = [], []
