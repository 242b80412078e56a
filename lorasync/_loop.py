"""The publisher's event-loop machinery: its own loop in a daemon thread for sync callers
(:class:`LoopThread`) and the lock its calls share across loops and threads (:class:`LoopLock`).
The background phase a publish leaves running is :mod:`lorasync._background`'s.

``Publisher.publish`` (sync) submits its coroutine to the loop thread, so engine clients keep
their connections (and TLS setup) from step to step, whether or not the caller's thread already
runs a loop (notebooks, async trainers); ``apublish`` runs on the caller's loop. Both take the
same lock, so it cannot be an ``asyncio.Lock`` (bound to one loop); a ``threading.Lock`` taken
through ``asyncio.to_thread`` parks one executor thread per waiter (enough waiters starve the
holder's own engine calls) and cannot be handed a "closed" error, hence :class:`LoopLock`: a FIFO
of futures on the waiters' own loops, written here because neither asyncio nor anyio has a lock
shared by several event loops.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from lorasync.errors import PublisherClosedError

__all__ = ["UNWIND_S", "LoopLock", "LoopThread", "held"]

T = TypeVar("T")

#: How long a cancelled background phase, or the loop thread's leftover tasks, get to unwind. A
#: cancellation lands at the next await, at once, unless the loop it runs on is itself blocked.
UNWIND_S = 2.0

#: Loops a forked child inherited: kept referenced and never closed there, because closing (or
#: collecting) one would unregister its descriptors from the epoll set it shares with the parent.
_INHERITED: list[Any] = []


class LoopThread:
    """An event loop in a daemon thread, started on first use; sync code submits coroutines.

    Once stopped it stays stopped: a later :meth:`run` raises ``PublisherClosedError``.
    """

    def __init__(self, name: str = "lorasync-publisher") -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()
        self._stopped = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop, once started (None before, and after :meth:`stop`)."""
        return self._loop

    @property
    def running(self) -> bool:
        return self._loop is not None

    @property
    def accepting(self) -> bool:
        """:meth:`submit` would take work (it was not stopped)."""
        return not self._stopped

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop (starting it); returns its future.

        Raises:
            PublisherClosedError: the loop thread was stopped.
        """
        with self._guard:
            if self._stopped:
                coro.close()
                raise PublisherClosedError("the publisher was closed; make a new Publisher to publish again")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=_serve, args=(loop,), name=self._name, daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            # Scheduled under the guard: stop() queues the loop's end after every accepted call.
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and return its result (re-raising its exception).

        Raises:
            PublisherClosedError: the loop was stopped before or while it ran.
        """
        future = self.submit(coro)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            if not self._stopped:
                raise
            raise PublisherClosedError("the publisher was closed while this call waited; make a new Publisher to publish again") from None
        except BaseException:
            # KeyboardInterrupt in the caller: cancel the coroutine so it releases what it holds.
            future.cancel()
            raise

    async def arun(self, coro: Coroutine[Any, Any, T]) -> T:
        """:meth:`run` for a coroutine on another loop: awaits instead of blocking."""
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self) -> None:
        """Stop taking work, cancel what is left on the loop, stop it and join its thread
        (idempotent). Callers still waiting in :meth:`run` get ``PublisherClosedError``."""
        with self._guard:
            self._stopped = True
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
            if loop is not None:
                loop.call_soon_threadsafe(loop.stop)
        if thread is not None and thread is not threading.current_thread():
            thread.join(2 * UNWIND_S + 1.0)  # _serve cancels what is left and ends its workers, bounded, then closes the loop

    def forget_after_fork(self) -> None:
        """In a forked child: the loop thread is the parent's. Let go of it without touching it."""
        if self._loop is not None:
            _INHERITED.append(self._loop)
        self._guard = threading.Lock()
        self._loop = self._thread = None
        self._stopped = True


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.wait(left, timeout=UNWIND_S))
            # Its worker threads (engine calls, file writes) end before close() returns, so a
            # closed publisher leaves no thread behind; bounded: a stuck engine call is not waited out.
            with contextlib.suppress(asyncio.TimeoutError, RuntimeError):
                loop.run_until_complete(asyncio.wait_for(loop.shutdown_default_executor(), UNWIND_S))
        finally:
            loop.close()


# -- the lock -------------------------------------------------------------------------------------

_WAITING, _GRANTED, _GONE = "waiting", "granted", "gone"


@dataclass(eq=False)
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    state: str = _WAITING


class LoopLock:
    """A FIFO lock for coroutines on any event loop, in any thread (see the module docstring).

    A waiter cancelled while waiting never leaves it held. :meth:`refuse` fails every waiter
    with an error at once and refuses later acquisitions, except the closer's.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._refusal: Callable[[], BaseException] | None = None

    @property
    def locked(self) -> bool:
        return self._held

    @contextlib.asynccontextmanager
    async def hold(self, *, closer: bool = False) -> AsyncIterator[None]:
        """Hold the lock for the ``async with`` block.

        Raises:
            whatever :meth:`refuse` was given, for everyone but the ``closer``.
        """
        await self._acquire(closer)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, closer: bool) -> None:
        loop = asyncio.get_running_loop()
        with self._mutex:
            if self._refusal is not None and not closer:
                raise self._refusal()
            if not self._held:
                self._held = True
                return
            waiter = _Waiter(loop, loop.create_future())
            self._waiters.append(waiter)
        try:
            await waiter.future
        except BaseException:
            with self._mutex:
                granted = waiter.state == _GRANTED
                if not granted:
                    waiter.state = _GONE
                    with contextlib.suppress(ValueError):
                        self._waiters.remove(waiter)
            if granted:  # handed over as it was cancelled: pass it on
                self._release()
            raise

    def _release(self) -> None:
        with self._mutex:
            while self._waiters:
                waiter = self._waiters.popleft()
                if waiter.state != _WAITING:
                    continue
                waiter.state = _GRANTED
                try:
                    waiter.loop.call_soon_threadsafe(_resolve, waiter.future)
                except RuntimeError:  # its loop is closed: it will never take it
                    waiter.state = _GONE
                    continue
                return
            self._held = False

    def refuse(self, error: Callable[[], BaseException]) -> None:
        """From now on every acquisition but the closer's raises ``error()``; waiters get it now."""
        with self._mutex:
            self._refusal = error
            failing = [w for w in self._waiters if w.state == _WAITING]
            for waiter in failing:
                waiter.state = _GONE
            self._waiters.clear()
        for waiter in failing:
            with contextlib.suppress(RuntimeError):
                waiter.loop.call_soon_threadsafe(_fail, waiter.future, error())


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _fail(future: asyncio.Future[None], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def held(lock: LoopLock, *, closer: bool = False) -> contextlib.AbstractAsyncContextManager[None]:
    """``async with held(lock):`` — :meth:`LoopLock.hold`."""
    return lock.hold(closer=closer)
