"""In-place transport: one plain name switches atomically to each new version.

Only for engines whose ``capabilities().load_inplace`` is True (the in-process PEFT engine): vLLM
0.32's ``load_inplace`` re-reads files every step and reuses stale prefix-cache blocks, and SGLang
has no in-place update. Tensors are handed over directly to in-process engines that take them;
otherwise the version is written to the disk store once and swapped in by path.

A failed verification puts the previous version back (:meth:`InPlaceTransport.restore`) from what
the publisher kept of it: the version's files, or an owned copy (design invariant 7). Never from
the Adapter it was published from: a no-copy export wraps the trainer's tensors, which the
optimizer has moved on since.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from lorasync.transports._snapshot import kept_by, owned_copy
from lorasync.transports._transport import Delivery, Transport
from lorasync.transports.disk import DiskTransport
from lorasync.runtime._loop import to_thread_untracked

if TYPE_CHECKING:
    from lorasync.adapter._adapter import Adapter
    from lorasync.engines._engine import Capabilities, Engine

__all__ = ["InPlaceTransport"]


class InPlaceTransport(Transport):
    """``engine.replace_adapter[_tensors](name, ...)``: the served name never changes.

    Args:
        disk (`DiskTransport`): where versions are written when the engine loads by path.
        files (`bool | None`): True: always through files; False: always tensors; None: tensors
            for in-process engines that take them, files otherwise.
    """

    name = "inplace"
    versioned = False

    def __init__(self, disk: DiskTransport, *, files: bool | None = None) -> None:
        self._disk = disk
        self._files = files

    def unsupported(self, caps: Capabilities) -> str | None:
        if not caps.load_inplace:
            return "engine cannot swap an adapter in place safely; publish versioned names (in_place=False, the default)"
        return None

    def uses_files(self, caps: Capabilities) -> bool:
        """Whether a delivery to an engine with ``caps`` goes through the disk store."""
        return self._files if self._files is not None else not (caps.in_process and caps.tensor_load)

    async def deliver(self, adapter: Adapter, engine: Engine, caps: Capabilities, *, name: str, version: int, served: str) -> Delivery:
        timings: dict[str, float] = {}
        if self.uses_files(caps):
            path, _, timings["write"] = await self._disk.write(adapter, name, version)
            start = time.perf_counter()
            await engine.areplace_adapter(name, path)
        else:
            start = time.perf_counter()
            # An engine that keeps what it is handed must not keep the trainer's tensors (invariant 7).
            handed = await to_thread_untracked(owned_copy, adapter) if kept_by(engine) else adapter
            await engine.areplace_adapter_tensors(name, handed)
        timings["load"] = time.perf_counter() - start
        return Delivery(served_name=name, bytes_moved=adapter.nbytes, timings=timings)

    async def restore(self, engine: Engine, *, name: str, previous: Adapter | str) -> None:
        """Put a previous version back under ``name`` (after a failed verification): from its
        directory (a path) or from an owned copy of it (never the trainer's live tensors)."""
        if isinstance(previous, str):
            await engine.areplace_adapter(name, previous)
        else:
            await engine.areplace_adapter_tensors(name, previous)

    async def retire(self, engine: Engine, *, name: str, version: int, served: str) -> None:
        """Nothing to unload: the name stays, its weights were replaced."""
