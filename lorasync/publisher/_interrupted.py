"""What a cancelled publish leaves on one engine, settled to its end even if cancelled again.

A cancel waits for a delivery it cannot stop where leaving it running would serve weights no one
published (``Publisher._publish_one``): with a probe, or where the delivery swaps a name in place
or merges. Once it has landed, the version is taken out of service (unverified:
:func:`withdraw_cancelled`) or, without a probe, kept as any load is when it holds what was
published and taken out when the tensors changed under it (:func:`keep_cancelled`). The caller
re-raises the cancel either way; a failure here is logged with what may still serve. A cancel is
held ``CANCELLED_CALL_WAIT_S`` at most (:func:`to_the_end`), the take-out or record after a landed
delivery included (the bound counts from the cancel, not from a second one that never comes); a
delivery, take-out or record still running then is the next publish's to wait for, and what serves
in place or merged is unknown (:func:`left_running`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from lorasync.engines._engine import Capabilities
from lorasync.publisher import _cancelled
from lorasync.publisher._digest import PublishDigest
from lorasync.publisher._handle import EngineHandle
from lorasync.publisher._retention import Ledger
from lorasync.runtime._loop import finish
from lorasync.transports._transport import Transport

__all__ = ["keep_cancelled", "left_running", "settle_to_the_end", "to_the_end", "withdraw_cancelled"]

T = TypeVar("T")

log = logging.getLogger("lorasync.publish")


async def to_the_end(awaitable: Awaitable[T], *, cancelled_at: float | None = None) -> T:
    """``finish``, with a cancel held ``CANCELLED_CALL_WAIT_S`` at most: no cancel hangs on an
    engine call that never returns (it runs on; the next publish waits for it, bounded, as for
    any call a cancel left running: :mod:`lorasync.publisher._cancelled`). ``cancelled_at``: the
    caller handles a cancel that came then; the bound counts from it."""
    return await finish(awaitable, bound=_cancelled.CANCELLED_CALL_WAIT_S, cancelled_at=cancelled_at)


async def settle_to_the_end(
    handle: EngineHandle, ledger: Ledger, transport: Transport, version: int, work: Awaitable[T], *, cancelled_at: float | None = None
) -> T:
    """:func:`to_the_end` for a take-out or record after a delivery: one still running when a
    cancel's bound passes is the next publish's to wait for (:func:`left_running`), never work
    that runs on unseen (a swap back, or a ledger record, landing after the next publish's)."""
    task = asyncio.ensure_future(work)
    try:
        return await to_the_end(task, cancelled_at=cancelled_at)
    except asyncio.CancelledError:
        if not task.done():
            left_running(handle, ledger, transport, version, task)
        raise


async def _settled(handle: EngineHandle, ledger: Ledger, transport: Transport, version: int, work: Awaitable[None], cancelled_at: float | None) -> None:
    """Run ``work`` (a take-out or record after a cancel) to its end, within the cancel's bound
    counted from ``cancelled_at`` (now if None); past it, the next publish waits for it and what
    serves in place or merged is unknown (:func:`left_running`), as for a delivery."""
    with contextlib.suppress(asyncio.CancelledError):  # the caller re-raises the cancel it handles
        await settle_to_the_end(handle, ledger, transport, version, work, cancelled_at=time.monotonic() if cancelled_at is None else cancelled_at)


async def withdraw_cancelled(
    handle: EngineHandle, ledger: Ledger, transport: Transport, version: int, *, caps: Capabilities, previous: Any, cancelled_at: float | None = None
) -> None:
    """Take a version whose verification was cancelled (at ``cancelled_at``, now if None) out of
    service (in place and merged: the previous weights back)."""
    try:
        await _settled(handle, ledger, transport, version, handle.take_out(ledger, transport, version, caps=caps, previous=previous), cancelled_at)
    except Exception as exc:  # noqa: BLE001 - the cancel goes on; say what is left serving
        log.warning("%s: taking %s v%d out of service after its verification was cancelled failed (%s); publish again or unload it", handle.where, handle.name, version, exc)


async def keep_cancelled(
    handle: EngineHandle,
    ledger: Ledger,
    transport: Transport,
    version: int,
    hashing: PublishDigest,
    digest: str,
    *,
    caps: Capabilities,
    previous: Any,
    path: str | None,
    restore: Any,
    live: bool,
    cancelled_at: float | None = None,
) -> None:
    """A publish without a probe was cancelled after its delivery landed: record the version as
    served if it holds what was published (``live``: it read the trainer's tensors, which must not
    have changed meanwhile), else take it out."""

    async def settle() -> None:
        if live and hashing.changed() is not None:
            await handle.take_out(ledger, transport, version, caps=caps, previous=previous)
        else:
            await handle.delivered(ledger, transport, version, digest, path=path, restore=restore)

    try:
        await _settled(handle, ledger, transport, version, settle(), cancelled_at)
    except Exception as exc:  # noqa: BLE001 - the cancel goes on; say what is left serving
        log.warning("%s: settling %s v%d, delivered as its publish was cancelled, failed (%s); publish again", handle.where, handle.name, version, exc)


def left_running(handle: EngineHandle, ledger: Ledger, transport: Transport, version: int, delivery: asyncio.Future[Any]) -> None:
    """A cancel stopped waiting for ``delivery`` past its bound: it may still swap or merge. What
    the engine serves in place or merged is unknown from here (never "unchanged" against it, no
    older version over it), and the next publish waits for the delivery (bounded) before it moves."""
    handle.cancelled.left_running(delivery)
    if not transport.versioned:
        ledger.in_place = ledger.in_place_source = ledger.merged = None
        ledger.floor = max(version, ledger.floor or version)
