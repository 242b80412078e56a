"""IPC transport: tensors handed to the engine without files (shared memory or CUDA IPC,
chosen by the engine client).

Fan-out: the engines of one publish share one :class:`lorasync.wire.shm.SegmentScope`, so the
adapter is copied into shared memory once for all engines on this host, not once per engine;
the scope is released when the last of them has loaded (or failed). An engine in this process
that keeps what it is handed gets an owned copy instead of the trainer's tensors, made once per
publish and shared by every such engine (design invariant 7).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from lorasync.transports._snapshot import kept_by, owned_copy
from lorasync.transports._transport import Delivery, Transport
from lorasync.wire.shm import SegmentScope, sharing
from lorasync.runtime._loop import to_thread_untracked

if TYPE_CHECKING:
    from lorasync.adapter._adapter import Adapter
    from lorasync.engines._engine import Capabilities, Engine

__all__ = ["IPCTransport"]


class IPCTransport(Transport):
    """``engine.load_adapter_tensors(served, adapter)``: no files are written."""

    name = "ipc"

    def __init__(self) -> None:
        # (name, version) -> [scope, engines in flight, the owned copy in-process engines keep]
        self._scopes: dict[tuple[str, int], list[Any]] = {}

    def unsupported(self, caps: Capabilities) -> str | None:
        if not caps.lora or not caps.runtime_lora:
            return "engine cannot load LoRA adapters at runtime"
        if not caps.tensor_load:
            return "engine has no tensor-load route (vLLM: start it with the lorasync worker extension and VLLM_SERVER_DEV_MODE=1)"
        if not caps.same_host:
            return "shared memory needs the engine on this host"
        return None

    async def deliver(self, adapter: Adapter, engine: Engine, caps: Capabilities, *, name: str, version: int, served: str) -> Delivery:
        start = time.perf_counter()
        entry = self._scopes.setdefault((name, version), [SegmentScope(), 0, None])
        entry[1] += 1
        try:
            handed = adapter
            if kept_by(engine):
                if entry[2] is None:
                    # A Task, so engines of one publish awaiting it concurrently share one copy.
                    entry[2] = asyncio.ensure_future(to_thread_untracked(owned_copy, adapter))
                handed = await asyncio.shield(entry[2])
            with sharing(entry[0]):
                await engine.aload_adapter_tensors(served, handed)
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._scopes[(name, version)]
                entry[0].close()
        return Delivery(served_name=served, bytes_moved=adapter.nbytes, timings={"load": time.perf_counter() - start})
