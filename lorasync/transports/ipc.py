"""IPC transport: tensors handed to the engine without files (shared memory or CUDA IPC,
chosen by the engine client)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from lorasync.transports._base import Delivery, Transport

if TYPE_CHECKING:
    from lorasync._adapter import Adapter
    from lorasync.engines._base import Capabilities, Engine

__all__ = ["IPCTransport"]


class IPCTransport(Transport):
    """``engine.load_adapter_tensors(served, adapter)``: no files are written."""

    name = "ipc"

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
        await engine.aload_adapter_tensors(served, adapter)
        return Delivery(served_name=served, bytes_moved=adapter.nbytes, timings={"load": time.perf_counter() - start})
