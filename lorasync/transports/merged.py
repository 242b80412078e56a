"""Merged transport: the fallback for engines that cannot serve LoRA (or not this one).

Each touched base weight becomes ``W0 + s·B·A``, folded from the pristine base (never from an
engine's already-merged weight), streamed to the engine in buckets of bounded size. The engines
of one publish that need the same buckets share one fold (:class:`~lorasync.transports._fold.SharedFold`). Modules an
earlier merge touched but this adapter does not get their pristine W0 back. The engine brackets
the buckets (``begin/end_weight_update``) so requests never see half an update; if a bucket
fails, the previous merge is pushed back before the error propagates, and after a failed
verification :meth:`MergedTransport.rollback` does the same.

What is merged, and what a roll-back pushes, is folded from an owned copy of the adapter
(:class:`~lorasync.transports._snapshot.OwnedAdapter`, taken once per publish; the publisher
hands one over), never from the trainer's tensors (design invariant 7): a no-copy export's
tensors have moved on by the time the previous merge is put back. The copy is of the LoRA
factors only, small beside the base weights every merge folds and pushes.

Cancellation (``asyncio.wait_for``, ``task.cancel``) is an exit path like any other: every engine
step runs in a worker thread that a cancel cannot stop, so each step is waited for before the
cancel goes on (:func:`_finish`); the roll-back and the end of the update run to completion even
if cancelled again. The engine's update gate is therefore released on every path, and the engine
serves either the previous merge or the new one, never a mix.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from lorasync.runtime._loop import finish as _finish
from lorasync.runtime._loop import to_thread_untracked
from lorasync.transports._transport import Delivery, Transport
from lorasync.transports._base_weights import BaseWeights
from lorasync.transports._fold import SharedFold, fold_buckets
from lorasync.transports._snapshot import owned_copy

if TYPE_CHECKING:
    from lorasync.adapter._adapter import Adapter
    from lorasync.engines._engine import Capabilities, Engine

__all__ = ["DEFAULT_BUCKET_BYTES", "GPU_BUCKET_BYTES", "MergedTransport"]


DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
#: Buckets folded on a GPU. Each bucket costs the engine one weight-update call (an RPC and vLLM's
#: reload pass) whatever its size: about 40-60 ms on an H100 with the Qwen3-8B shape (2026-12-07),
#: where the bytes of a 256 MiB bucket cross device to device in well under 1 ms. The 13.9 GB fold
#: took 3.1-4.3 s in 256 MiB buckets against 0.67-0.84 s for every parameter in 1 GiB ones (TRL's
#: bucket). Peak extra GPU memory stays about two buckets.
GPU_BUCKET_BYTES = 1024 * 1024 * 1024

# What each engine holds now (by ``Engine.instance_id``), as far as this process knows: the
# merged transport that merged it last and the owned copy it merged. Two publishers of this
# process merging into one engine (two jobs) thus restore each other's modules, roll a failed
# merge back to what the engine really held, and know when theirs was overwritten (``serves``).
# What other processes merge into an engine cannot be known here.
_HELD: dict[str, tuple[object, Adapter]] = {}


class MergedTransport(Transport):
    """Fold and push merged weights.

    Args:
        base (`BaseWeights`): the pristine base weights.
        bucket_bytes (`int`, *optional*): upper bound of one pushed bucket (peak extra memory ≈ 2
            buckets); default ``GPU_BUCKET_BYTES`` (1 GiB) for a fold on a GPU, else
            ``DEFAULT_BUCKET_BYTES`` (256 MiB).
        device: where to fold (``"cuda"`` folds on GPU); default: the GPU a GPU adapter lives on,
            else where the base weights are.
    """

    name = "merged"
    versioned = False

    def __init__(self, base: BaseWeights, *, bucket_bytes: int | None = None, device: str | torch.device | None = None) -> None:
        self.base = base
        self.bucket_bytes = bucket_bytes
        self.device = device
        self._previous: dict[int, tuple[object, Adapter] | None] = {}  # id(engine) -> what it held before our last merge
        # One fold per publish for every engine that needs the same buckets: key -> [fold, engines in flight, owned copy].
        self._shared: dict[tuple[Any, ...], list[Any]] = {}
        self._token = object()  # this transport, in _HELD

    def _device_for(self, adapter: Adapter | None) -> str | torch.device | None:
        """Where to fold: the device given, else the GPU the adapter lives on (a trainer's GPU
        adapter folds there, and its buckets go to an engine on this host device to device),
        else where the base weights are."""
        if self.device is not None or adapter is None:
            return self.device
        devices = {t.device for t in adapter.tensors.values()}
        if len(devices) == 1 and next(iter(devices)).type == "cuda":
            return next(iter(devices))
        return None

    def _bucket_bytes(self, device: str | torch.device | None) -> int:
        """The bucket for a fold on ``device`` (None: where W0 is, as the fold itself decides)."""
        if self.bucket_bytes is not None:
            return self.bucket_bytes
        where = torch.device(device) if device is not None else self.base.device
        return GPU_BUCKET_BYTES if where is not None and where.type == "cuda" else DEFAULT_BUCKET_BYTES

    def unsupported(self, caps: Capabilities) -> str | None:
        if not caps.weight_update:
            return "engine has no weight-update route"
        return None

    def serves(self, engine: Engine) -> bool:
        """Whether ``engine`` still holds this transport's last merge as far as this process can
        tell (False once another publisher of this process merged into it, or restored it)."""
        held = _HELD.get(engine.instance_id)
        return held is not None and held[0] is self._token

    async def deliver(self, adapter: Adapter, engine: Engine, caps: Capabilities, *, name: str, version: int, served: str) -> Delivery:
        held = _HELD.get(engine.instance_id)  # whoever merged it: its modules go back to W0 unless this one touches them
        restore = set(held[1].modules) if held is not None else set()
        start = time.perf_counter()
        key = (version, id(adapter), frozenset(restore), tuple(map(tuple, caps.fused_modules)))
        entry = self._shared.setdefault(key, [None, 0, None])
        if entry[0] is None:
            entry[2] = owned = owned_copy(adapter)  # one copy for every engine of the publish (none when given one)
            device = self._device_for(owned)
            entry[0] = SharedFold(lambda: fold_buckets(owned, self.base, bucket_bytes=self._bucket_bytes(device), restore=restore, fused=caps.fused_modules, device=device))
        shared, entry[1], merging = entry[0].join(), entry[1] + 1, entry[2]  # joined before any await: all engines of the publish
        try:
            moved = await self._deliver(engine, merging, held, restore, caps, shared)
        finally:
            entry[1] -= 1
            if entry[1] == 0 and self._shared.get(key) is entry:
                del self._shared[key]
        return Delivery(served_name="", bytes_moved=moved, timings={"load": time.perf_counter() - start})

    async def _deliver(self, engine: Engine, adapter: Adapter, held: tuple[object, Adapter] | None, restore: set[str], caps: Capabilities, shared: Iterator[dict[str, torch.Tensor]] | None) -> int:
        previous = held[1] if held is not None else None
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
            _HELD[engine.instance_id], self._previous[id(engine)] = (self._token, adapter), held  # before the end: a cancel there keeps it true
        finally:
            await _finish(engine.aend_weight_update())
        return moved

    async def _push(self, engine: Engine, adapter: Adapter | None, restore: set[str], caps: Capabilities, shared: Iterator[dict[str, torch.Tensor]] | None = None) -> int:
        device = self._device_for(adapter)
        buckets: Iterator[dict[str, torch.Tensor]] = shared if shared is not None else fold_buckets(
            adapter, self.base, bucket_bytes=self._bucket_bytes(device), restore=restore, fused=caps.fused_modules, device=device
        )
        moved = 0
        while True:
            # A cancel lands between buckets, never while a fold or an update still runs in
            # its thread (the roll-back would race it).
            bucket = await _finish(to_thread_untracked(next, buckets, None))
            if bucket is None:
                return moved
            await _finish(engine.aupdate_weights(bucket))
            moved += sum(t.numel() * t.element_size() for t in bucket.values())
            del bucket

    async def retire(self, engine: Engine, *, name: str, version: int, served: str) -> None:
        """Nothing to unload: the next merge replaces this one."""

    async def rollback(self, engine: Engine, caps: Capabilities) -> bool:
        """Put back what the engine held before this transport's last merge into it (after a
        failed verification), folded from the owned copy kept of it, or the pristine base.

        Returns:
            Whether a merge (not the pristine base) serves again.
        """
        held = _HELD.get(engine.instance_id)
        if held is None or held[0] is not self._token:
            return held is not None  # what the engine holds is not ours to take back
        before = self._previous.pop(id(engine), None)
        await _begin(engine)
        try:
            await _finish(self._push(engine, before[1] if before is not None else None, set(held[1].modules), caps))
        finally:
            if before is None:
                _HELD.pop(engine.instance_id, None)
            else:
                _HELD[engine.instance_id] = before
            await _finish(engine.aend_weight_update())
        return before is not None

    async def restore(self, engine: Engine, caps: Capabilities) -> int:
        """Put the pristine base weights back on every module this transport's merge touched,
        if the engine still holds it; bytes pushed."""
        self._previous.pop(id(engine), None)
        held = _HELD.get(engine.instance_id)
        if held is None or held[0] is not self._token:
            return 0
        await _begin(engine)
        try:
            return await _finish(self._push(engine, None, set(held[1].modules), caps))
        finally:
            _HELD.pop(engine.instance_id, None)
            await _finish(engine.aend_weight_update())


def _stop(reader: Any) -> None:
    """Leave the shared fold (a reader still folding in a worker thread leaves when it ends)."""
    reader.close()


async def _begin(engine: Engine) -> None:
    """``abegin_weight_update``; cancelled while it waits for the gate, the gate it then gets
    is given back before the cancel goes on."""
    try:
        await _finish(engine.abegin_weight_update())
    except asyncio.CancelledError:
        await _finish(engine.aend_weight_update())
        raise
