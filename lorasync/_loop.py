"""The publisher's own event loop, in a daemon thread, for sync callers; a thread lock held
from async code without leaking it on cancellation; and the one background phase a publish
leaves running after it returned (retirement), awaited by whoever comes next.

``Publisher.publish`` (sync) submits its coroutine here, so engine clients keep their connections
(and TLS setup) from step to step, whether or not the caller's thread already runs a loop
(notebooks, async trainers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

__all__ = ["Background", "LoopThread", "held", "wait_done"]

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


class Background:
    """At most one coroutine running after its caller returned (a publish's retirement), on the
    caller's loop; whoever comes next waits for it first, from any loop or thread.

    A loop that stops or closes while the coroutine is unfinished abandons it (``asyncio.run``
    cancels it on the way out): :meth:`wait` then returns False, and the caller must not trust
    the state the coroutine was updating.
    """

    def __init__(self) -> None:
        self._task: asyncio.Task[Any] | None = None
        self.done: concurrent.futures.Future[None] | None = None

    @property
    def pending(self) -> bool:
        """Something was started and not waited for yet."""
        return self._task is not None

    def start(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[None]:
        """Run ``coro`` on the running loop; returns a future done when it ends (however)."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        task = asyncio.ensure_future(coro)
        task.add_done_callback(lambda t: done.set_result(None) if not done.done() else None)
        self._task, self.done = task, done
        return done

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait for the coroutine started last; whether it finished (not cancelled or abandoned).

        Past ``timeout`` seconds it is cancelled (it must be cancellation-safe) and False returned:
        the caller redoes its work, so one stuck engine call never blocks every later publish.
        A cancellation of the waiter leaves the coroutine running (and still awaited next time).
        """
        task, done = self._task, self.done
        if task is None or done is None:
            return True
        loop = task.get_loop()
        if not task.done():
            if loop is not asyncio.get_running_loop() and (loop.is_closed() or not loop.is_running()):
                # Its loop stopped: it would never finish here. Cancel it, so that should that
                # loop ever run again it unwinds instead of acting on state that moved on.
                with contextlib.suppress(RuntimeError):
                    task.cancel()
                self._task = self.done = None
                return False
            # Shielded: a cancellation of the waiter must not cancel the work (nor its future).
            ended = asyncio.shield(asyncio.wrap_future(done))
            try:
                await asyncio.wait_for(ended, timeout)
            except asyncio.TimeoutError:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(task.cancel)
                await asyncio.wait({asyncio.wrap_future(done)}, timeout=timeout)  # let it unwind (bounded)
        self._task = self.done = None
        return task.done() and not task.cancelled() and task.exception() is None


def wait_done(done: concurrent.futures.Future[None] | None, loop: asyncio.AbstractEventLoop | None, timeout: float | None) -> None:
    """Block until ``done`` (from :meth:`Background.start` on ``loop``).

    Raises:
        RuntimeError: called on ``loop`` itself, which could then never finish it.
        TimeoutError: not done within ``timeout`` seconds.
    """
    if done is None or done.done():
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is not None and running is loop:
        raise RuntimeError("cannot block on a publish's retirement from the event loop that runs it: use `await report.asettled()`")
    done.result(timeout)
