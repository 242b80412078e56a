"""The publisher's event-loop machinery: its own loop in a daemon thread for sync callers
(:class:`LoopThread`); the lock its calls share across loops and threads is
:mod:`lorasync.runtime._looplock`'s.
The background phase a publish leaves running is :mod:`lorasync.runtime._background`'s.

Blocking engine and file calls run in daemon threads of lorasync's own (:func:`to_thread`,
:class:`DaemonPool`), never in a thread the interpreter or ``asyncio.run`` joins at its end: a
publish's background retirement stuck in a slow engine unload must not hold a script's exit, or
the exit of ``asyncio.run``, until the engine answers (issue 33, items 13 and 17). Whatever such a
call left undone is found again from the engine's own listing by the next publisher of the run.
At the interpreter's exit, calls still running get :data:`EXIT_WAIT_S` in all to end
(:func:`_drain_at_exit`): a daemon thread that comes back from C++ code (a torch copy) after the
interpreter began to finalize is torn down by ``pthread_exit`` through ``noexcept`` frames, and the
process aborts (``terminate called without an active exception``, exit status -6) after the
script's last line ran well. A background phase's next call (the loop thread lives on until the
end, and nobody waits for the phase) would start just as the wait ended, so none starts from then
on (:func:`in_background`; it is cancelled, and what it would have done is found again, as above).
A call someone waits for still runs: an exit hook registered before lorasync was imported runs
after the drain, and its ``publish()`` or ``close()`` must end as at any other time. Calls stuck
longer are left as before: the exit is not held. A forked child's pools start afresh
(:func:`_after_fork_in_child`): its exit waits for none of its parent's calls.

``Publisher.publish`` (sync) submits its coroutine to the loop thread, so engine clients keep
their connections (and TLS setup) from step to step, whether or not the caller's thread already
runs a loop (notebooks, async trainers); ``apublish`` runs on the caller's loop. Both take the
same lock (:class:`~lorasync.runtime._looplock.LoopLock`).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import contextvars
import functools
import itertools
import os
import queue
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from lorasync.errors import PublisherClosedError

__all__ = ["BOUND_PASSED", "UNWIND_S", "DaemonPool", "LoopThread", "finish", "gather_all", "in_background", "to_thread", "to_thread_pool", "to_thread_untracked", "tracked_calls"]

T = TypeVar("T")

#: How long a cancelled background phase, or the loop thread's leftover tasks, get to unwind. A
#: cancellation lands at the next await, at once, unless the loop it runs on is itself blocked.
UNWIND_S = 2.0

#: How long the interpreter's exit waits, in all, for calls still running in lorasync's threads
#: (see the module docstring): long enough for a call that was ending, short of holding an exit
#: on a stuck engine.
EXIT_WAIT_S = 2.0

#: Loops a forked child inherited: kept referenced and never closed there, because closing (or
#: collecting) one would unregister its descriptors from the epoll set it shares with the parent.
_INHERITED: list[Any] = []


class DaemonPool(concurrent.futures.ThreadPoolExecutor):
    """A thread pool whose threads are daemon and end after ``idle_s`` without work.

    ``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits (and
    ``asyncio.run`` when it returns), however long the call they run takes; this one does not.
    ``shutdown(wait=True)`` still joins its threads (a closed publisher leaves none behind). A
    ``ThreadPoolExecutor`` by type only (``loop.set_default_executor`` takes nothing else); every
    method it has is its own.
    """

    def __init__(self, name: str, *, max_workers: int = 32, idle_s: float = 1.0) -> None:  # noqa: D107 - no super(): none of its state is used
        self._name = name
        self._max = max_workers
        self._idle_s = idle_s
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any], bool] | None] = queue.SimpleQueue()
        self._mutex = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._free = 0  # threads waiting for work
        self._queued = 0  # work not taken yet
        self._shut = False
        self._ids = itertools.count()
        self._running = 0  # calls in progress
        self._ended = threading.Condition(self._mutex)
        _ALL.add(self)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:  # type: ignore[override]
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        background = _BACKGROUND.get()
        if background and _EXITING.is_set():
            future.cancel()  # a background phase's call, at the exit: none starts (module docstring)
            return future
        with self._mutex:
            if self._shut:
                raise RuntimeError("cannot schedule new work after shutdown")
            self._queued += 1
            self._queue.put((future, functools.partial(fn, *args, **kwargs), background))
            if self._free < self._queued and len(self._threads) < self._max:
                thread = threading.Thread(target=self._work, name=f"{self._name}_{next(self._ids)}", daemon=True)
                self._threads.add(thread)
                thread.start()
        return future

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._mutex:
                self._free += 1
            try:
                item = self._queue.get(timeout=self._idle_s)
            except queue.Empty:
                item = None
            with self._mutex:
                self._free -= 1
                if item is None:  # idle, or woken by shutdown
                    if self._queued == 0:
                        self._threads.discard(me)
                        return
                    continue  # work came in meanwhile: take it
                self._queued -= 1
            future, call, background = item
            if background and _EXITING.is_set():
                future.cancel()  # queued by a background phase before the exit: it does not start now
                del item, future, call
                continue
            if future.set_running_or_notify_cancel():
                with self._mutex:
                    self._running += 1
                try:
                    future.set_result(call())
                except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits it
                    future.set_exception(exc)
                finally:
                    with self._mutex:
                        self._running -= 1
                        self._ended.notify_all()
            del item, future, call

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more work; end the threads once the work queued is done (``wait``: join them)."""
        with self._mutex:
            self._shut = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(None)  # wakes a waiting thread at once
        if wait:
            self.join(None)

    def join(self, timeout: float | None) -> bool:
        """Wait for the threads (at most ``timeout`` seconds in all); whether they all ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._mutex:
            threads = [t for t in self._threads if t is not threading.current_thread()]
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    def wait_running(self, deadline: float) -> bool:
        """Wait until no call runs in this pool, or ``deadline`` (``time.monotonic()``); whether none runs."""
        with self._mutex:
            return self._ended.wait_for(lambda: self._running == 0, max(0.0, deadline - time.monotonic()))

    def after_fork(self) -> None:
        """In a forked child: the parent's threads do not exist here; start afresh."""
        self._mutex = threading.Lock()
        self._ended = threading.Condition(self._mutex)
        self._queue = queue.SimpleQueue()
        self._threads = set()
        self._free = self._queued = self._running = 0


#: Every pool, for :func:`_drain_at_exit` and :func:`_after_fork_in_child`.
_ALL: weakref.WeakSet[DaemonPool] = weakref.WeakSet()
#: Set once the interpreter exits: no background phase's call starts after that (module docstring).
_EXITING = threading.Event()
#: Whether the calls started in this context are a background phase's (:func:`in_background`).
_BACKGROUND: contextvars.ContextVar[bool] = contextvars.ContextVar("lorasync_background", default=False)


def in_background() -> None:
    """Mark the current task as a background phase that nobody waits for (a publish's retirement):
    at the interpreter's exit none of its calls start (see the module docstring)."""
    _BACKGROUND.set(True)


@atexit.register
def _drain_at_exit() -> None:
    """Start no more calls of background phases; give those still running in lorasync's threads
    :data:`EXIT_WAIT_S` in all to end (see the module docstring)."""
    _EXITING.set()
    deadline = time.monotonic() + EXIT_WAIT_S
    for pool in list(_ALL):
        pool.wait_running(deadline)


def _after_fork_in_child() -> None:
    """Every pool starts afresh in a forked child: the parent's threads, their calls and a lock one
    of them may have held do not exist there (the child's exit waits for none of them)."""
    for pool in list(_ALL):
        pool.after_fork()


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
                pool = DaemonPool(f"{self._name}-io")
                loop.set_default_executor(pool)  # its asyncio.to_thread calls: daemon threads too
                _POOLS[loop] = pool
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
        loop.run_forever()
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
            loop.close()


os.register_at_fork(after_in_child=_after_fork_in_child)


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
