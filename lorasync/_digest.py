"""One content hash per publish, computed once by whoever needs it first.

The disk transport hashes the bytes in the pass that writes them (:meth:`DiskStore.write_hashed`),
so a disk publish reads the adapter's memory once; engines that take tensors (ipc, merged,
in-place) hash it on its own. Engines of one fan-out run concurrently: the first one to ask
computes, the others wait for that value instead of hashing again. Never carried over from an
earlier publish: the trainer's tensors may have changed in place since (dedup decides on the
bytes of this publish).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorasync._adapter import Adapter

__all__ = ["PublishDigest"]


class PublishDigest:
    """The content hash of one publish's adapter.

    Args:
        adapter (`Adapter`): what is published.
    """

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter
        self.value: str | None = None
        self.seconds = 0.0  # spent in a hashing pass of its own (0 when the write pass gave it)
        self._lock = asyncio.Lock()

    async def get(self, compute: Callable[[], Awaitable[str]] | None = None) -> str:
        """The hash: known, or from ``compute`` (e.g. a write that hashes), or a hashing pass."""
        async with self._lock:
            if self.value is None:
                if compute is not None:
                    self.value = await compute()
                else:
                    start = time.perf_counter()
                    self.value = await asyncio.to_thread(lambda: self.adapter.content_hash)
                    self.seconds += time.perf_counter() - start
            return self.value
