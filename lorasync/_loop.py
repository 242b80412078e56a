"""The publisher's own event loop, in a daemon thread, for sync callers; and a thread lock held
from async code without leaking it on cancellation.

``Publisher.publish`` (sync) submits its coroutine here, so engine clients keep their connections
(and TLS setup) from step to step, whether or not the caller's thread already runs a loop
(notebooks, async trainers).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread", "held"]

T = TypeVar("T")


class LoopThread:
    """An event loop in a daemon thread, started on first use; sync code submits coroutines."""

    def __init__(self, name: str = "lorasync-publisher") -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and return its result (re-raising its exception)."""
        with self._guard:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name=self._name, daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            loop = self._loop
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result()
        except BaseException:
            # KeyboardInterrupt in the caller: cancel the coroutine so it releases what it holds.
            future.cancel()
            raise

    @property
    def running(self) -> bool:
        return self._loop is not None

    def stop(self) -> None:
        """Stop the loop and join its thread (idempotent)."""
        with self._guard:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()


@contextlib.asynccontextmanager
async def held(lock: threading.Lock) -> AsyncIterator[None]:
    """Hold a thread lock from async code; a cancellation while waiting never leaves it held.

    The lock is shared by sync publishes (on the publisher's loop) and async ones (on the
    caller's loops), so it cannot be an ``asyncio.Lock``.
    """
    acquiring = asyncio.ensure_future(asyncio.to_thread(lock.acquire))
    try:
        await asyncio.shield(acquiring)
    except asyncio.CancelledError:
        # The worker thread may still get the lock after we stop waiting: give it back then.
        acquiring.add_done_callback(lambda f: lock.release() if not f.cancelled() and f.exception() is None and f.result() else None)
        raise
    try:
        yield
    finally:
        lock.release()
