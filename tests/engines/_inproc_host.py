"""An AsyncLLM on its own event loop in a thread, as a trainer's rollout loop would hold it.

Shared by the in-process vLLM peers (``peer_vllm_inprocess*.py``), which run in the vLLM engine venv.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any


class AsyncHost:
    """Build ``AsyncLLM(model=model_dir, **args)`` on a loop of its own; ``run`` a coroutine there."""

    def __init__(self, model_dir: str, **args: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.llm = self.run(self._make(model_dir, args))

    async def _make(self, model_dir: str, args: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_dir, **args))

    def run(self, coro: Any, timeout: float = 600) -> Any:
        return self.submit(coro).result(timeout=timeout)

    def submit(self, coro: Any) -> Any:
        """Start ``coro`` on the AsyncLLM's loop; returns its ``concurrent.futures.Future``."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.llm.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


def hosted(mode: str, model_dir: str, args: dict[str, Any]) -> Iterator[Any]:
    """The body of a peer's module-scoped ``host`` fixture: an :class:`AsyncHost` (``mode``
    ``"async"``) or a ``vllm.LLM``, shut down afterwards."""
    if mode == "async":
        host = AsyncHost(model_dir, **args)
        yield host
        host.close()
    else:
        from vllm import LLM

        yield LLM(model=model_dir, **args)


def connect_to(mode: str, host: Any) -> Any:
    """The in-process engine over ``host`` (connected on the AsyncLLM's loop for ``"async"``)."""
    from lorasync.engines import connect
    from lorasync.engines.vllm.inprocess import VLLMInProcessEngine

    made = connect("vllm-inprocess", llm=host.llm, loop=host.loop) if mode == "async" else connect("vllm-inprocess", llm=host)
    assert isinstance(made, VLLMInProcessEngine) and made.is_async == (mode == "async")
    return made
