"""The publisher's event-loop machinery: its own loop in a daemon thread for sync callers
(:class:`LoopThread`); the lock its calls share across loops and threads is
:mod:`lorasync.runtime._looplock`'s.
The background phase a publish leaves running is :mod:`lorasync.runtime._background`'s; what a
sync caller's one call sees when a Ctrl-C, a cancel or the loop's end comes between the call and
its answer is :mod:`lorasync.runtime._calls`'s.

Blocking engine and file calls run in daemon threads of lorasync's own (:func:`to_thread`,
:class:`DaemonPool`), never in a thread the interpreter or ``asyncio.run`` joins at its end: a
publish's background retirement stuck in a slow engine unload must not hold a script's exit, or
the exit of ``asyncio.run``, until the engine answers (issue 33, items 13 and 17). Whatever such a
call left undone is found again from the engine's own listing by the next publisher of the run.
The pools, and what the interpreter's exit and a fork do to their calls, are
:mod:`lorasync.runtime._pool`'s.

``Publisher.publish`` (sync) submits its coroutine to the loop thread, so engine clients keep
their connections (and TLS setup) from step to step, whether or not the caller's thread already
runs a loop (notebooks, async trainers); ``apublish`` runs on the caller's loop. Both take the
same lock (:class:`~lorasync.runtime._looplock.LoopLock`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from lorasync.errors import PublisherClosedError
from lorasync.runtime._pool import DaemonPool, exiting, in_background
from lorasync.runtime._calls import _OUTSTANDING, INTERRUPTED_WAIT_S, _schedule

log = logging.getLogger(__name__)

__all__ = ["BOUND_PASSED", "UNWIND_S", "DaemonPool", "LoopThread", "finish", "exiting", "gather_all", "in_background", "to_thread", "to_thread_pool", "to_thread_untracked", "tracked_calls"]

T = TypeVar("T")

#: How long a cancelled background phase, or the loop thread's leftover tasks, get to unwind. A
#: cancellation lands at the next await, at once, unless the loop it runs on is itself blocked.
UNWIND_S = 2.0

#: Loops a forked child inherited: kept referenced and never closed there, because closing (or
#: collecting) one would unregister its descriptors from the epoll set it shares with the parent.
_INHERITED: list[Any] = []


#: Where :func:`to_thread` runs calls from a loop that is not a publisher's own (the caller's).
_SHARED = DaemonPool("lorasync-io")
#: A publisher loop's own pool (its default executor), ended with the loop.
_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DaemonPool] = weakref.WeakKeyDictionary()


#: Where :func:`to_thread` notes the calls it starts, inside :func:`tracked_calls`.
_TRACKED: contextvars.ContextVar[list[concurrent.futures.Future[Any]] | None] = contextvars.ContextVar("lorasync_tracked_calls", default=None)


async def to_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``asyncio.to_thread`` in a daemon thread (see the module docstring): the context variables
    follow the call, as they do with ``asyncio.to_thread``."""
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    pool = _POOLS.get(loop, _SHARED)
    calls = _TRACKED.get()
    if calls is None:
        return await loop.run_in_executor(pool, call)
    future = pool.submit(call)
    calls.append(future)
    return await asyncio.wrap_future(future, loop=loop)


async def to_thread_untracked(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """:func:`to_thread`, never noted by :func:`tracked_calls`: for work that is no engine's
    (a store write), which an engine's next call must not wait for."""
    token = _TRACKED.set(None)
    try:
        return await to_thread(fn, *args, **kwargs)
    finally:
        _TRACKED.reset(token)


def to_thread_pool(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
    """Start ``fn`` in lorasync's shared daemon threads and return at once (nothing awaits it:
    work a cancelled call leaves for after it, which nothing must cancel in turn)."""
    return _SHARED.submit(functools.partial(contextvars.copy_context().run, fn, *args, **kwargs))


@contextlib.contextmanager
def tracked_calls() -> Iterator[list[concurrent.futures.Future[Any]]]:
    """Note the thread calls :func:`to_thread` starts in this context (and in the tasks started
    from it) in the list yielded: a cancel stops the awaiting, never the call in its thread, and
    whoever comes next may have to wait for it (``EngineHandle.cancelled``)."""
    calls: list[concurrent.futures.Future[Any]] = []
    token = _TRACKED.set(calls)
    try:
        yield calls
    finally:
        _TRACKED.reset(token)


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

    def submit(self, coro: Coroutine[Any, Any, T], *, _into: list[concurrent.futures.Future[T]] | None = None) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop (starting it); returns its future (also appended to
        ``_into`` as soon as it exists, before the loop is woken: :meth:`run` reads it there).

        Raises:
            PublisherClosedError: the loop thread was stopped.
        """
        with self._guard:
            if self._stopped:
                coro.close()
                raise PublisherClosedError("the publisher was closed; make a new Publisher to publish again")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                pool = DaemonPool(f"{self._name}-io")
                loop.set_default_executor(pool)  # its asyncio.to_thread calls: daemon threads too
                _POOLS[loop] = pool
                thread = threading.Thread(target=_serve, args=(loop,), name=self._name, daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            # Scheduled under the guard: stop() queues the loop's end after every accepted call.
            return _schedule(self._loop, coro, _into)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and return its result (re-raising its exception).

        Raises:
            PublisherClosedError: the loop was stopped before or while it ran.
        """
        made: list[concurrent.futures.Future[T]] = []  # the future, from the moment it exists
        try:
            return self.submit(coro, _into=made).result()
        except concurrent.futures.CancelledError:
            if not self._stopped:
                raise
            raise PublisherClosedError("the publisher was closed while this call waited; make a new Publisher to publish again") from None
        except BaseException:
            # KeyboardInterrupt in the caller, wherever it landed (waking the loop, returning
            # from submit, waiting): cancel the coroutine so it releases what it holds, and let
            # it handle that cancel (bounded; a second Ctrl-C ends the wait) before the caller's
            # next line runs: a publish then has recorded what it left (lease() refuses a version
            # it cancelled before every engine recorded it), instead of racing it.
            if made:
                made[0].cancel()
                made[0].lorasync_ended.wait(INTERRUPTED_WAIT_S)  # type: ignore[attr-defined]
            raise

    async def arun(self, coro: Coroutine[Any, Any, T]) -> T:
        """:meth:`run` for a coroutine on another loop: awaits instead of blocking."""
        return await asyncio.wrap_future(self.submit(coro))

    def let_go(self, last: Callable[[], None]) -> None:
        """:meth:`stop` for a finalizer: never waits and takes no lock. The collector runs
        finalizers in whatever thread allocates, holding whatever that thread holds (even this
        loop's own thread), so nothing here may block. ``last`` runs in the loop's thread as the
        loop ends (here, if it never started or has stopped); exceptions from it are dropped."""
        self._stopped = True  # nothing can submit any more: the owner is unreachable
        loop, self._loop, self._thread = self._loop, None, None

        def end() -> None:
            try:
                last()
            except Exception:  # noqa: BLE001 - a finalizer has no one to tell
                pass
            finally:
                if loop is not None:
                    loop.stop()

        if loop is None:
            end()
            return
        try:
            loop.call_soon_threadsafe(end)
        except RuntimeError:  # the loop is closed already
            end()

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
        while True:
            try:
                loop.run_forever()
                break  # stop() or let_go()
            except (SystemExit, KeyboardInterrupt) as exc:
                # Raised in a task a call's work awaits (a gather's child): asyncio lets it out of
                # run_forever, which would end the loop under every call. The task holds it; its
                # awaiter gets it, and the call's caller with it (_Escaped). The loop serves on.
                log.warning("a lorasync call's task raised %s on the publisher's loop; it goes to that call's caller", type(exc).__name__)
    finally:
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.wait(left, timeout=UNWIND_S))
            # Its worker threads (engine calls, file writes) end before close() returns, so a
            # closed publisher leaves no thread behind; bounded: a stuck engine call is not waited
            # out (not loop.shutdown_default_executor: its joining thread is not a daemon).
            pool = _POOLS.pop(loop, None)
            if pool is not None:
                pool.shutdown(wait=False)
                pool.join(UNWIND_S)
        finally:
            for future in list(_OUTSTANDING.pop(loop, ())):
                future.cancel()  # its work outlived the unwinding: its caller stops waiting (closed)
                future.lorasync_ended.set()  # type: ignore[attr-defined]
            loop.close()


async def finish(awaitable: Awaitable[T], *, bound: float | None = None, cancelled_at: float | None = None) -> T:
    """Await ``awaitable`` to its end even if the caller is cancelled meanwhile; a cancel that
    arrived is raised (``CancelledError``) once it has finished, or ``bound`` seconds after the
    cancel if it has not (it runs on; a caller that must never hang passes one).

    Args:
        cancelled_at: the caller was cancelled already, at this ``time.monotonic()`` (it handles
            that cancel by running ``awaitable``): the bound counts from then, and the cancel is
            raised at the end as for one that arrives meanwhile.

    Raises:
        asyncio.CancelledError: the caller was cancelled while it ran (it completed, or the bound
            passed: ``BOUND_PASSED``); its ``cancelled_at`` attribute says when the cancel came.
        Exception: whatever ``awaitable`` raised.
    """
    task = asyncio.ensure_future(awaitable)
    while True:
        try:
            if cancelled_at is None or bound is None:
                result = await asyncio.shield(task)
                break
            left = cancelled_at + bound - time.monotonic()
            if left <= 0 or not (await asyncio.wait({task}, timeout=left))[0]:
                task.add_done_callback(_retrieve)  # left running past the bound: nobody awaits it now
                raise _cancel(cancelled_at, BOUND_PASSED)
            result = task.result()
            break
        except asyncio.CancelledError as exc:
            if task.done() or (cancelled_at is not None and bound is not None and time.monotonic() >= cancelled_at + bound):
                exc.cancelled_at = getattr(exc, "cancelled_at", None) or cancelled_at  # type: ignore[attr-defined]
                raise  # the work itself was cancelled, or the bound passed
            cancelled_at = cancelled_at if cancelled_at is not None else time.monotonic()
    if cancelled_at is not None:
        raise _cancel(cancelled_at)
    return result


def _cancel(cancelled_at: float, *args: str) -> asyncio.CancelledError:
    exc = asyncio.CancelledError(*args)
    exc.cancelled_at = cancelled_at  # type: ignore[attr-defined]
    return exc


#: The message of the ``CancelledError`` :func:`finish` raises when its bound passed before the work ended.
BOUND_PASSED = "cancelled; the work it waited for still runs past its bound"


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" for work left behind


async def gather_all(*awaitables: Awaitable[T]) -> list[T]:
    """Await every one concurrently; a cancel reaches each and is raised only once every one has
    ended (``asyncio.gather`` raises at the first that ends cancelled, while others may still be
    finishing work a cancel must wait for).

    Raises:
        asyncio.CancelledError: the caller was cancelled (every awaitable has ended).
        BaseException: the first that one of them raised.
    """
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]
