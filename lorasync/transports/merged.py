"""Merged transport: the fallback for engines that cannot serve LoRA (or not this one).

Each touched base weight becomes ``W0 + s·B·A``, folded from the pristine base (never from an
engine's already-merged weight), streamed to the engine in buckets of bounded size. The engines
of one publish that need the same buckets share one fold (:class:`~lorasync.transports._fold.SharedFold`). Modules an
earlier merge touched but this adapter does not get their pristine W0 back. The engine brackets
the buckets (``begin/end_weight_update``) so requests never see half an update; if a bucket
fails, the previous merge is pushed back before the error propagates.

Cancellation (``asyncio.wait_for``, ``task.cancel``) is an exit path like any other: every engine
step runs in a worker thread that a cancel cannot stop, so each step is waited for before the
cancel goes on (:func:`_finish`); the roll-back and the end of the update run to completion even
if cancelled again. The engine's update gate is therefore released on every path, and the engine
serves either the previous merge or the new one, never a mix.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from lorasync.transports._transport import Delivery, Transport
from lorasync.transports._base_weights import BaseWeights
from lorasync.transports._fold import SharedFold, fold_buckets

if TYPE_CHECKING:
    from lorasync._adapter import Adapter
    from lorasync.engines._engine import Capabilities, Engine

__all__ = ["MergedTransport"]

T = TypeVar("T")

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


class MergedTransport(Transport):
    """Fold and push merged weights.

    Args:
        base (`BaseWeights`): the pristine base weights.
        bucket_bytes (`int`): upper bound of one pushed bucket (peak extra memory ≈ 2 buckets).
        device: where to fold (``"cuda"`` folds on GPU).
    """

    name = "merged"
    versioned = False

    def __init__(self, base: BaseWeights, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: str | torch.device | None = None) -> None:
        self.base = base
        self.bucket_bytes = bucket_bytes
        self.device = device
        self._merged: dict[int, Adapter] = {}  # id(engine) -> adapter merged there now
        # One fold per publish for every engine that needs the same buckets: key -> [fold, engines in flight].
        self._shared: dict[tuple[Any, ...], list[Any]] = {}

    def unsupported(self, caps: Capabilities) -> str | None:
        if not caps.weight_update:
            return "engine has no weight-update route"
        return None

    async def deliver(self, adapter: Adapter, engine: Engine, caps: Capabilities, *, name: str, version: int, served: str) -> Delivery:
        previous = self._merged.get(id(engine))
        restore = set(previous.modules) if previous is not None else set()
        start = time.perf_counter()
        key = (version, id(adapter), frozenset(restore), tuple(map(tuple, caps.fused_modules)))
        entry = self._shared.setdefault(key, [None, 0])
        if entry[0] is None:
            entry[0] = SharedFold(lambda: fold_buckets(adapter, self.base, bucket_bytes=self.bucket_bytes, restore=restore, fused=caps.fused_modules, device=self.device))
        shared, entry[1] = entry[0].join(), entry[1] + 1  # joined before any await: all engines of the publish
        try:
            moved = await self._deliver(engine, adapter, previous, restore, caps, shared)
        finally:
            entry[1] -= 1
            if entry[1] == 0 and self._shared.get(key) is entry:
                del self._shared[key]
        self._merged[id(engine)] = adapter
        return Delivery(served_name="", bytes_moved=moved, timings={"load": time.perf_counter() - start})

    async def _deliver(self, engine: Engine, adapter: Adapter, previous: Adapter | None, restore: set[str], caps: Capabilities, shared: Iterator[dict[str, torch.Tensor]] | None) -> int:
        await _begin(engine)
        try:
            try:
                moved = await self._push(engine, adapter, restore, caps, shared)
            except BaseException:
                if shared is not None:
                    _stop(shared)  # leave the shared fold: the other engines need not wait for us
                # Put the engine back on the previous merge (or the pristine base) so it never
                # serves half of this version; a second cancel must not cut that short.
                await _finish(self._push(engine, previous, set(adapter.modules), caps))
                raise
            self._merged[id(engine)] = adapter  # before the end: a cancel there keeps it true
        finally:
            await _finish(engine.aend_weight_update())
        return moved

    async def _push(self, engine: Engine, adapter: Adapter | None, restore: set[str], caps: Capabilities, shared: Iterator[dict[str, torch.Tensor]] | None = None) -> int:
        buckets: Iterator[dict[str, torch.Tensor]] = shared if shared is not None else fold_buckets(
            adapter, self.base, bucket_bytes=self.bucket_bytes, restore=restore, fused=caps.fused_modules, device=self.device
        )
        moved = 0
        while True:
            # A cancel lands between buckets, never while a fold or an update still runs in
            # its thread (the roll-back would race it).
            bucket = await _finish(asyncio.to_thread(next, buckets, None))
            if bucket is None:
                return moved
            await _finish(engine.aupdate_weights(bucket))
            moved += sum(t.numel() * t.element_size() for t in bucket.values())
            del bucket

    async def retire(self, engine: Engine, *, name: str, version: int, served: str) -> None:
        """Nothing to unload: the next merge replaces this one."""

    async def restore(self, engine: Engine, caps: Capabilities) -> int:
        """Put the pristine base weights back on every module a merge touched; bytes pushed."""
        previous = self._merged.pop(id(engine), None)
        if previous is None:
            return 0
        await _begin(engine)
        try:
            return await _finish(self._push(engine, None, set(previous.modules), caps))
        finally:
            await _finish(engine.aend_weight_update())


def _stop(reader: Any) -> None:
    """Leave the shared fold (a reader still folding in a worker thread leaves when it ends)."""
    reader.close()


async def _finish(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` to its end even if the caller is cancelled meanwhile; a cancel that
    arrived is raised (``CancelledError``) once it has finished.

    Raises:
        asyncio.CancelledError: the caller was cancelled while it ran (it did complete).
        Exception: whatever ``awaitable`` raised.
    """
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():  # the work itself was cancelled, not just the caller
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


async def _begin(engine: Engine) -> None:
    """``abegin_weight_update``; cancelled while it waits for the gate, the gate it then gets
    is given back before the cancel goes on."""
    try:
        await _finish(engine.abegin_weight_update())
    except asyncio.CancelledError:
        await _finish(engine.aend_weight_update())
        raise
