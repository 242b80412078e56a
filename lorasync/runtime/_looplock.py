"""The lock a publisher's (and a Fleet's) calls share across event loops and threads.

Both ``Publisher.publish`` (on the publisher's loop thread) and ``apublish`` (on the caller's
loop) take it, so it cannot be an ``asyncio.Lock`` (bound to one loop); a ``threading.Lock``
taken through ``asyncio.to_thread`` parks one executor thread per waiter (enough waiters starve
the holder's own engine calls) and cannot be handed a "closed" error, hence :class:`LoopLock`:
a FIFO of futures on the waiters' own loops, written here because neither asyncio nor anyio has a
lock shared by several event loops.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

__all__ = ["LoopLock", "held"]

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
