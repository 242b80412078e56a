"""lorasync's own thread pools (:class:`DaemonPool`), where blocking engine and file calls run
(see :mod:`lorasync.runtime._loop`), and what the interpreter's exit and a fork do to their calls.

At the interpreter's exit, calls still running get :data:`EXIT_WAIT_S` in all to end
(:func:`_drain_at_exit`): a daemon thread that comes back from C++ code (a torch copy) after the
interpreter began to finalize is torn down by ``pthread_exit`` through ``noexcept`` frames, and the
process aborts (``terminate called without an active exception``, exit status -6) after the
script's last line ran well. A background phase's next call (the loop thread lives on until the
end, and nobody waits for the phase) would start just as the wait ended, so none starts from then
on (:func:`in_background`; it is cancelled, and the next publisher of the run finds what it
would have done from the engine's own listing).
A call someone waits for still runs: an exit hook registered before lorasync was imported runs
after the drain, and its ``publish()`` or ``close()`` must end as at any other time; such a
publish runs its retirement before it returns (:func:`exiting`), as a background phase's calls
would no longer start. Calls stuck longer are left as before: the exit is not held. A forked child's pools start afresh
(:func:`_after_fork_in_child`): its exit waits for none of its parent's calls.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextvars
import functools
import itertools
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["EXIT_WAIT_S", "DaemonPool", "exiting", "in_background"]

T = TypeVar("T")

#: How long the interpreter's exit waits, in all, for calls still running in lorasync's threads
#: (see the module docstring): long enough for a call that was ending, short of holding an exit
#: on a stuck engine.
EXIT_WAIT_S = 2.0

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


def exiting() -> bool:
    """Whether the interpreter exits (lorasync's exit hook ran): a publish then runs its
    retirement before it returns rather than in a background phase that no call would start."""
    return _EXITING.is_set()


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


os.register_at_fork(after_in_child=_after_fork_in_child)
