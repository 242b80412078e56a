"""One call of a sync caller onto a publisher's loop thread: its future, who starts or closes its
work, and how its answer reaches the caller (:func:`_schedule`, used by
:class:`~lorasync.runtime._loop.LoopThread`).

Apart from ``_loop`` because it is the one place that decides what a caller sees when a Ctrl-C,
a cancel, a ``SystemExit`` or the loop's end comes between the call and its answer; each of
those cases is a test in ``tests/test_loop_thread.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger("lorasync.runtime._loop")  # where users and tests have always found these lines

T = TypeVar("T")

#: How long a sync call interrupted by Ctrl-C waits for its work to handle the cancel: a publish's
#: cancel handling is bounded by ``publisher._cancelled.CANCELLED_CALL_WAIT_S`` (5 s), counted from the cancel.
INTERRUPTED_WAIT_S = 6.0


async def _answered(coro: Coroutine[Any, Any, T], future: list[concurrent.futures.Future[T]], ended: threading.Event) -> T:
    """Run ``coro`` for :meth:`LoopThread.submit`; an error it raises after its caller gave up
    on it (Ctrl-C in a sync call, a cancelled ``await``: the caller's future was cancelled while
    the work finished what it must) is logged once here, since no one is left to receive it
    (asyncio would print "Task exception was never retrieved" with its traceback at exit)."""
    try:
        return await coro
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - a SystemExit is handed to the caller whole (_Escaped)
        if future and future[0].cancelled():
            _gave_up_on(exc)
            raise asyncio.CancelledError from exc
        if isinstance(exc, Exception):
            raise
        raise _Escaped(exc) from None
    finally:
        ended.set()


def _schedule(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], into: list[concurrent.futures.Future[T]] | None = None) -> concurrent.futures.Future[T]:
    """``asyncio.run_coroutine_threadsafe``, with the caller's future made before the loop is woken.

    A Ctrl-C can land while the loop is being woken (``call_soon_threadsafe`` writes to its
    self-pipe). ``run_coroutine_threadsafe`` made its future inside that call: the caller got the
    ``KeyboardInterrupt`` and no future, while the work, already queued, started and ran on with
    nothing to cancel it. Here the future exists first, and whichever side claims the coroutine
    first decides its fate: the loop's callback starts it, or the interrupted caller closes it
    unstarted (the callback, queued or not, then does nothing). Started work is cancelled through
    the future (the caller, :meth:`LoopThread.run`, gives it ``INTERRUPTED_WAIT_S`` to handle the
    cancel); work whose future was cancelled before the loop took it never starts.
    """
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    ended = threading.Event()
    claim = threading.Lock()  # taken once: by the callback that starts the work, or by its caller
    future.lorasync_ended = ended  # type: ignore[attr-defined]
    if into is not None:
        into.append(future)
    outstanding = _OUTSTANDING.setdefault(loop, set())
    outstanding.add(future)
    future.add_done_callback(outstanding.discard)

    def start() -> None:
        if not claim.acquire(blocking=False):
            return  # the caller was interrupted first and closed the coroutine
        if future.cancelled():  # given up on before the loop took it (Ctrl-C, a cancelled arun)
            coro.close()
            ended.set()
            return
        task = loop.create_task(_answered(coro, [future], ended))

        def settle(task: asyncio.Task[T]) -> None:
            ended.set()  # also for a task cancelled before its first step (_answered never ran)
            if task.cancelled():
                coro.close()  # unstarted: closed, never "never awaited"; finished: nothing to do
                future.cancel()  # as run_coroutine_threadsafe's: the caller sees CancelledError
                return
            error = task.exception()
            if not future.set_running_or_notify_cancel():
                # Cancelled by its caller, after _answered had looked (it logs what the work
                # raises once its caller gave up): said here, since no one else will.
                if error is not None:
                    _gave_up_on(error.escaped if isinstance(error, _Escaped) else error)
                return
            if isinstance(error, _Escaped):
                future.set_exception(error.escaped)
            elif error is not None:
                future.set_exception(error)
            else:
                future.set_result(task.result())

        def cancel(done: concurrent.futures.Future[T]) -> None:
            if done.cancelled() and not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the task ended with it
                    loop.call_soon_threadsafe(task.cancel)

        task.add_done_callback(settle)
        future.add_done_callback(cancel)

    try:
        loop.call_soon_threadsafe(start)
    except BaseException:
        future.cancel()  # started: the cancel reaches the work; not yet: it never starts
        if claim.acquire(blocking=False):
            coro.close()  # never started, and now never will be
            ended.set()
        raise
    return future


class _Escaped(Exception):
    """A ``BaseException`` the work raised that is no cancel (``SystemExit``, ``KeyboardInterrupt``
    raised by hand): carried to the caller as what it is, instead of escaping the task and
    stopping the loop under every other call (whose callers would then wait forever)."""

    def __init__(self, escaped: BaseException) -> None:
        super().__init__(type(escaped).__name__)  # never the escaped one's repr: it may raise
        self.escaped = escaped


#: The callers' futures of each loop's calls not answered yet: a loop that ends (stop() does not
#: wait for work slower than UNWIND_S to handle its cancel) cancels them, so no caller waits on.
_OUTSTANDING: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, set[concurrent.futures.Future[Any]]] = weakref.WeakKeyDictionary()


def _gave_up_on(exc: BaseException) -> None:
    log.warning("a lorasync call its caller gave up on failed afterwards: %s: %s", type(exc).__name__, exc)
