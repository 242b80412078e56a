"""Disk transport: an atomic versioned directory of the publisher's run (tmpfs by default) that the
engine loads by path."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lorasync.transports._transport import Delivery, Transport
from lorasync.transports._store import DiskStore

if TYPE_CHECKING:
    from lorasync.adapter._adapter import Adapter
    from lorasync.engines._engine import Capabilities, Engine

__all__ = ["DiskTransport"]


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

    async def _write_once(self, adapter: Adapter, name: str, version: int) -> _Written:
        lock = self._locks.setdefault((name, version), asyncio.Lock())
        async with lock:
            done = self._written.get((name, version))
            if done is not None and done.adapter is adapter:
                return done
            start = time.perf_counter()
            path, written, digest = await asyncio.to_thread(self.store.write_hashed, adapter, name, version)
            done = _Written(adapter, str(path), digest, written, time.perf_counter() - start, new=written > 0)
            self._written[(name, version)] = done
            return done

    async def deliver(self, adapter: Adapter, engine: Engine, caps: Capabilities, *, name: str, version: int, served: str) -> Delivery:
        # The version's directory belongs to this publisher's run: no other publisher collects it.
        path, written, write_s = await self.write(adapter, name, version)
        start = time.perf_counter()
        await engine.aload_adapter(served, path)
        load_s = time.perf_counter() - start
        size = sum(f.lstat().st_size for f in self.store.path_for(name, version).iterdir())
        return Delivery(served_name=served, bytes_moved=size, timings={"write": write_s, "load": load_s})


@dataclass
class _Written:
    adapter: Adapter
    path: str
    digest: str
    nbytes: int
    seconds: float
    new: bool
    unreported: bool = True
