"""lorasync's loop thread (runtime._loop.LoopThread), where every sync face of the public API runs
its async twin: what a caller who gives up on a call (Ctrl-C in ``publish()``, a cancelled
``await``) is left with."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from typing import Any

import pytest

from lorasync.errors import EngineUnavailableError
from lorasync.runtime._loop import LoopThread


async def _slow_to_cancel(started: threading.Event, handled: threading.Event, *, handling_s: float = 0.3) -> None:
    """Work that runs until cancelled, and then takes ``handling_s`` to handle the cancel."""
    started.set()
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        await asyncio.sleep(handling_s)  # the work the cancel must wait for
        handled.set()
        raise


def test_an_error_raised_after_the_caller_gave_up_is_logged_once_and_never_left_unretrieved(caplog) -> None:
    # The work handles the cancel by finishing what it must (as restore_base() finishes the
    # engine's resume), and that fails: the caller is gone, so nobody receives the error. asyncio
    # printed "Task exception was never retrieved" with a traceback at exit (seen on the H100
    # when the GPU tests were interrupted during restore_base()).
    caplog.set_level(logging.WARNING)
    thread = LoopThread("lorasync-test-loop")

    async def work() -> None:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            await asyncio.sleep(0.1)
            raise EngineUnavailableError("cannot reach vllm at http://127.0.0.1:1/resume") from None

    future = thread.submit(work())
    time.sleep(0.05)
    future.cancel()  # what run() does when the caller's wait is interrupted
    time.sleep(0.4)
    thread.stop()
    gc.collect()  # an unretrieved task exception is reported when the task is collected
    assert "never retrieved" not in caplog.text
    gave_up = [r for r in caplog.records if r.name == "lorasync.runtime._loop"]
    assert [r.getMessage() for r in gave_up] == [
        "a lorasync call its caller gave up on failed afterwards: EngineUnavailableError: cannot reach vllm at http://127.0.0.1:1/resume"
    ]


def test_an_error_of_a_call_still_awaited_reaches_its_caller() -> None:
    thread = LoopThread("lorasync-test-loop")

    async def work() -> None:
        raise EngineUnavailableError("down")

    try:
        thread.run(work())
    except EngineUnavailableError as exc:
        assert str(exc) == "down"
    else:  # pragma: no cover - the assertion's message
        raise AssertionError("the error did not reach the caller")
    finally:
        thread.stop()


def test_ctrl_c_in_a_sync_call_returns_once_the_work_handled_its_cancel() -> None:
    # Ctrl-C in publish() returned at once while the publish still handled its cancel (it waits
    # for an in-place swap it cannot stop and records what landed), so a lease() on the caller's
    # next line named what did not serve the version (outside attack, 15:14 session).
    import os
    import signal
    import sys
    import threading

    thread = LoopThread("lorasync-test-loop")
    started, handled = threading.Event(), threading.Event()

    def work() -> Any:
        return _slow_to_cancel(started, handled)

    caller = threading.get_ident()

    def waiting_for_the_result() -> bool:
        frame, names = sys._current_frames().get(caller), set()
        while frame is not None:
            names.add(frame.f_code.co_name)
            frame = frame.f_back
        return {"run", "result"} <= names

    def ctrl_c() -> None:
        # Ctrl-C while the caller waits in run() for the result: this test's case. (A Ctrl-C
        # that lands while run() is still inside submit(), waking the loop, is the next tests'.)
        started.wait(10)
        deadline = time.monotonic() + 10
        while not waiting_for_the_result() and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c, daemon=True).start()
    try:
        thread.run(work())
    except KeyboardInterrupt:
        assert handled.is_set(), "Ctrl-C returned before the work had handled its cancel"
    else:  # pragma: no cover - the assertion's message
        raise AssertionError("no KeyboardInterrupt reached the caller")
    finally:
        thread.stop()


class _Interrupted(BaseException):
    """Stands for the KeyboardInterrupt a Ctrl-C raises inside the loop's wake-up write."""


def _interrupt_the_wake_up(thread: LoopThread, monkeypatch, *, queued: bool, then: Any = None) -> None:
    """Make ``thread``'s next ``call_soon_threadsafe`` raise as a Ctrl-C would inside it: before
    the callback is queued, or after (the self-pipe write), optionally once ``then()`` returns."""
    thread.run(asyncio.sleep(0))  # the loop exists
    loop = thread.loop
    real = loop.call_soon_threadsafe

    def interrupted(callback: Any, *args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(loop, "call_soon_threadsafe", real)
        if queued:
            real(callback, *args, **kwargs)
            if then is not None:
                then()
        raise _Interrupted

    monkeypatch.setattr(loop, "call_soon_threadsafe", interrupted)


@pytest.mark.parametrize("queued", [False, True], ids=["before-queued", "after-queued"])
def test_ctrl_c_while_waking_the_loop_never_leaves_the_work_running(monkeypatch, queued: bool) -> None:
    # A Ctrl-C inside run_coroutine_threadsafe (its self-pipe write) reached the caller with no
    # future, while the work, already queued, ran on uncancelled (CI of the 18:40 session).
    import warnings

    thread = LoopThread("lorasync-test-loop")
    ran = threading.Event()

    async def work() -> None:
        ran.set()

    try:
        _interrupt_the_wake_up(thread, monkeypatch, queued=queued)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "coroutine ... was never awaited" fails the test
            with pytest.raises(_Interrupted):
                thread.run(work())
            thread.run(asyncio.sleep(0.05))  # whatever was queued has had its turn
            gc.collect()
        assert not ran.is_set(), "the interrupted call's work ran anyway"
    finally:
        thread.stop()


def test_ctrl_c_while_waking_the_loop_cancels_work_that_started(monkeypatch) -> None:
    # The loop took the call before the interrupted caller could take it back: the work is
    # cancelled, and the caller's Ctrl-C comes once the work handled its cancel.
    thread = LoopThread("lorasync-test-loop")
    started, handled = threading.Event(), threading.Event()

    def work() -> Any:
        return _slow_to_cancel(started, handled)

    try:
        _interrupt_the_wake_up(thread, monkeypatch, queued=True, then=lambda: started.wait(10))
        with pytest.raises(_Interrupted):
            thread.run(work())
        assert started.is_set()
        assert handled.is_set(), "Ctrl-C returned before the started work had handled its cancel"
    finally:
        thread.stop()


def test_work_given_up_on_before_the_loop_took_it_never_starts() -> None:
    # Outside attack (23:40 session): the future's cancel() answered True, and the work ran anyway.
    thread = LoopThread("lorasync-test-loop")
    gate, started = threading.Event(), threading.Event()

    async def busy() -> None:
        gate.wait(10)  # holds the loop thread before it takes the next call

    async def work() -> None:
        started.set()

    try:
        thread.submit(busy())
        time.sleep(0.1)
        future = thread.submit(work())
        assert future.cancel()
        gate.set()
        thread.run(asyncio.sleep(0.05))
        assert not started.is_set(), "work whose future was cancelled before it started ran anyway"
        assert future.lorasync_ended.is_set()
    finally:
        gate.set()
        thread.stop()


def test_ctrl_c_as_submit_returns_still_cancels_the_work(monkeypatch) -> None:
    # The interrupt lands after the loop was woken, before run() holds the future.
    from lorasync.runtime import _loop

    thread = LoopThread("lorasync-test-loop")
    started, handled = threading.Event(), threading.Event()
    real = _loop._schedule

    def work() -> Any:
        return _slow_to_cancel(started, handled, handling_s=0)

    def interrupted(*args: Any) -> Any:
        real(*args)
        started.wait(10)
        raise _Interrupted

    monkeypatch.setattr(_loop, "_schedule", interrupted)
    try:
        with pytest.raises(_Interrupted):
            thread.run(work())
        assert handled.is_set(), "the work ran on uncancelled"
    finally:
        thread.stop()


def test_a_call_accepted_before_stop_is_closed_and_ended_not_dropped() -> None:
    import warnings

    thread = LoopThread("lorasync-test-loop")
    gate = threading.Event()

    async def busy() -> None:
        gate.wait(10)

    async def work() -> int:
        return 1

    thread.submit(busy())
    time.sleep(0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        future = thread.submit(work())
        stopper = threading.Thread(target=thread.stop)
        stopper.start()
        time.sleep(0.1)
        gate.set()
        stopper.join(10)
        gc.collect()
    assert future.lorasync_ended.is_set() and future.done()


def test_work_raising_system_exit_reaches_its_caller_and_keeps_the_loop() -> None:
    thread = LoopThread("lorasync-test-loop")

    async def work() -> None:
        raise SystemExit(3)

    answer: dict[str, Any] = {}

    def call() -> None:
        try:
            thread.run(work())
        except BaseException as exc:  # noqa: BLE001 - what reached the caller
            answer["raised"] = exc

    try:
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(10)
        assert not caller.is_alive(), "run() hangs when the work raises SystemExit"
        assert isinstance(answer.get("raised"), SystemExit) and answer["raised"].code == 3
        assert thread.run(asyncio.sleep(0, result=5)) == 5  # the loop serves the next call
    finally:
        thread.stop()


def _answer_of(thread: LoopThread, coro: Any, *, within: float = 10.0) -> Any:
    """What ``thread.run(coro)`` answers (its value, or what it raised), from another thread;
    fails the test if it does not answer ``within`` seconds."""
    answer: dict[str, Any] = {}

    def call() -> None:
        try:
            answer["r"] = thread.run(coro)
        except BaseException as exc:  # noqa: BLE001 - what reached the caller
            answer["r"] = exc

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(within)
    assert not caller.is_alive(), "run() did not answer"
    return answer["r"]


def test_stop_answers_a_waiting_call_whose_work_outlives_the_unwinding() -> None:
    # Outside attack (00:00): stop() closed the loop with the task pending; run() waited forever.
    from lorasync.errors import PublisherClosedError
    from lorasync.runtime._loop import UNWIND_S

    thread = LoopThread("lorasync-test-loop")
    started, handled = threading.Event(), threading.Event()
    waiting: list[Any] = []
    caller = threading.Thread(target=lambda: waiting.append(_answer_of(thread, _slow_to_cancel(started, handled, handling_s=UNWIND_S + 1.5), within=20)), daemon=True)
    caller.start()
    assert started.wait(10)
    thread.stop()
    caller.join(20)
    assert waiting and isinstance(waiting[0], PublisherClosedError), waiting


def test_system_exit_in_a_task_the_work_awaits_reaches_the_caller_and_keeps_the_loop() -> None:
    import sys

    from lorasync.runtime._loop import gather_all

    thread = LoopThread("lorasync-test-loop")

    async def engine_call() -> None:
        await asyncio.sleep(0)
        sys.exit(3)  # user code in an engine call

    async def work() -> Any:
        return await gather_all(engine_call(), asyncio.sleep(0.1))

    try:
        raised = _answer_of(thread, work())
        assert isinstance(raised, SystemExit) and raised.code == 3, raised
        assert _answer_of(thread, asyncio.sleep(0, result=5)) == 5
    finally:
        thread.stop()


@pytest.mark.parametrize("error", [SystemExit(4), ValueError("late")], ids=["system-exit", "error"])
def test_what_work_raises_after_its_caller_gave_up_is_logged_once(caplog, error: BaseException) -> None:
    thread = LoopThread("lorasync-test-loop")
    started = threading.Event()
    caplog.set_level(logging.WARNING, logger="lorasync.runtime._loop")

    async def work() -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass  # finishes what it must, then fails
        raise error

    try:
        future = thread.submit(work())
        assert started.wait(10)
        future.cancel()
        assert future.lorasync_ended.wait(10)
        thread.run(asyncio.sleep(0.05))
        said = [r for r in caplog.records if "gave up on failed afterwards" in r.getMessage()]
        assert len(said) == 1 and type(error).__name__ in said[0].getMessage()
    finally:
        thread.stop()


def test_an_escaped_exit_whose_repr_raises_still_reaches_the_caller() -> None:
    class Odd(SystemExit):
        def __repr__(self) -> str:
            raise ValueError("repr not available")

    thread = LoopThread("lorasync-test-loop")

    async def work() -> None:
        raise Odd(5)

    try:
        assert isinstance(_answer_of(thread, work()), Odd)
    finally:
        thread.stop()


def test_an_error_raised_as_the_caller_gives_up_is_logged(caplog) -> None:
    # The cancel lands after the work raised, before its answer is settled: said, not lost.
    caplog.set_level(logging.WARNING, logger="lorasync.runtime._loop")
    thread = LoopThread("lorasync-test-loop")
    holder: dict[str, Any] = {}
    go = threading.Event()

    async def work() -> None:
        while not go.is_set():
            await asyncio.sleep(0.01)
        asyncio.get_running_loop().call_soon(holder["future"].cancel)  # runs before the settling
        raise RuntimeError("engine refused the load")

    try:
        holder["future"] = thread.submit(work())
        go.set()
        assert holder["future"].lorasync_ended.wait(10)
        thread.run(asyncio.sleep(0.05))
        assert holder["future"].cancelled()
        assert any("engine refused the load" in r.getMessage() for r in caplog.records)
    finally:
        thread.stop()
