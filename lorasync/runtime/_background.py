"""The one background phase a publish leaves running after it returned (its retirement), which
whoever comes next waits for, bounded (:class:`Background`), and the handle its report keeps on
it (:class:`Pending`).

The background phase (retirement) runs on the loop of the publish that started it. Whoever comes
next waits for it, at most ``timeout`` seconds from when it starts waiting: while it waits the
phase's loop is free (or another thread's), so a phase that does not finish then is stuck in an
engine call, not starved by a trainer that blocked its loop with compute. Past that, it is
cancelled for good: the caller marks what it was doing for a later retry and carries on. A phase
its loop dropped (``asyncio.run`` per step cancels what is left; a loop stopped or closed under
it) is run again on the publisher's own loop thread and reports into the same report.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from lorasync.runtime._loop import UNWIND_S, LoopThread, in_background
from lorasync.errors import PublisherClosedError

__all__ = ["Background", "Pending"]

log = logging.getLogger("lorasync.publish")


class Pending:
    """A background phase as its report sees it: wait for it from any thread or loop.

    Args:
        done: set once the phase is over (finished, or cancelled for good).
        guard: ``guard(call, twin)`` raises where blocking would deadlock (the publisher's).
    """

    def __init__(self, done: concurrent.futures.Future[None], guard: Callable[[str, str], None]) -> None:
        self.done = done
        self._guard = guard
        self._pid = os.getpid()

    def _check_process(self) -> None:
        if self._pid != os.getpid():
            raise PublisherClosedError(
                f"this report's retirement runs in process {self._pid}, not in this forked child "
                f"(pid {os.getpid()}); it can only be waited for there"
            )

    def wait(self, timeout: float | None) -> None:
        """Block until the phase is over.

        Raises:
            BlockingCallError: on a loop it would deadlock (use :meth:`wait_async`).
            PublisherClosedError: in a forked child. TimeoutError: not over within ``timeout``.
        """
        self._check_process()
        self._guard("report.settled()", "await report.asettled()")
        self.done.result(timeout)

    async def wait_async(self) -> None:
        self._check_process()
        if not self.done.done():
            await asyncio.wrap_future(self.done)


@dataclass(eq=False)
class _Run:
    work: Callable[[], Awaitable[Any]]
    done: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)
    task: asyncio.Task[Any] | None = None  # on the loop of the publish that started it
    rescue: concurrent.futures.Future[Any] | None = None  # run again on the publisher's loop thread
    given_up: bool = False


def _over(run: _Run) -> None:
    if not run.done.done():
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            run.done.set_result(None)


class Background:
    """At most one phase running after its caller returned (a publish's retirement); whoever
    comes next waits for it first, from any loop or thread (see the module docstring).

    Args:
        rescue (`LoopThread`): where a phase its loop dropped runs again.
    """

    def __init__(self, rescue: LoopThread) -> None:
        self._rescue = rescue
        self._run: _Run | None = None

    @property
    def pending(self) -> bool:
        """Something was started and not waited for yet."""
        return self._run is not None

    def start(self, work: Callable[[], Awaitable[Any]]) -> concurrent.futures.Future[None]:
        """Run ``work()`` on the running loop; returns a future set once it is over (however)."""
        run = _Run(work)
        run.task = asyncio.ensure_future(self._drive(run))
        self._run = run
        return run.done

    async def _drive(self, run: _Run) -> None:
        me = asyncio.current_task()
        in_background()  # this task's own context: nobody waits for its calls at the exit
        handed_over = False
        try:
            await run.work()
        except asyncio.CancelledError:
            # Not cancelled by us (we set given_up first): its loop is going away. Run it again.
            handed_over = run.task is me and not run.given_up and self._hand_over(run)
            if not handed_over:
                raise
        except Exception:  # the phase reports engine failures itself; anything else is a bug
            log.exception("the retirement after a publish failed")
        finally:
            if run.task is me and not handed_over:
                _over(run)

    def _hand_over(self, run: _Run) -> bool:
        """Run ``run`` again on the publisher's own loop thread; False if it takes no work."""
        if not self._rescue.accepting:
            return False
        run.task = None

        async def again() -> None:
            in_background()
            try:
                await run.work()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the retirement after a publish failed")
            finally:
                _over(run)

        coro = again()
        try:
            run.rescue = self._rescue.submit(coro)
        except PublisherClosedError:
            return False
        return True

    async def wait(self, timeout: float) -> bool:
        """Wait for the phase started last, at most ``timeout`` seconds; returns whether it
        finished. Past that it is cancelled for good (never redone here).

        A cancellation of the waiter leaves the phase running (and still awaited next time).
        """
        run = self._run
        if run is None:
            return True
        if not run.done.done() and run.task is not None and run.rescue is None:
            loop = run.task.get_loop()
            if loop is not asyncio.get_running_loop() and (loop.is_closed() or not loop.is_running()):
                # Its loop stopped under it without cancelling it. Should that loop ever run again,
                # the orphan unwinds (it is no longer the run's task), and the phase runs again here.
                orphan, run.task = run.task, None
                with contextlib.suppress(RuntimeError):
                    orphan.cancel()
                if not self._hand_over(run):
                    _over(run)
        finished = await _wait_for(run.done, timeout)
        if not finished:
            self._give_up(run)
            await _wait_for(run.done, UNWIND_S)
            _over(run)  # whoever waits in report.settled() is told now
        self._run = None
        return finished

    def _give_up(self, run: _Run) -> None:
        run.given_up = True
        if run.rescue is not None:
            run.rescue.cancel()
        elif run.task is not None:
            loop = run.task.get_loop()
            if loop is asyncio.get_running_loop():
                run.task.cancel()
            else:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(run.task.cancel)

    def forget_after_fork(self) -> None:
        """In a forked child: the phase runs in the parent."""
        self._run = None


async def _wait_for(done: concurrent.futures.Future[None], timeout: float) -> bool:
    if done.done():
        return True
    if timeout <= 0:
        return False
    try:
        # Shielded: a waiter that gives up (or is cancelled) must not cancel the work.
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(done)), timeout)
    except asyncio.TimeoutError:
        return False
    return True
