"""The runs this process holds in its stores (:mod:`lorasync.transports._store`'s bookkeeping):
``OWNED``, the run directories whose lock this process took (their descriptors stay open until it
exits), and ``LIVE``, the ones a store not closed yet uses; both under :data:`GUARD`.

A forked child starts with neither: an ``os.register_at_fork`` hook closes its copies of the lock
descriptors (a flock is shared with every copy of the descriptor, so a data-loader worker would
otherwise keep a dead trainer's run "alive").
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

__all__ = ["GUARD", "LIVE", "OWNED", "Guard"]

OWNED: dict[Path, int] = {}
LIVE: set[Path] = set()


class Guard:
    """The lock over ``OWNED`` and ``LIVE``, and the runs let go of while it was held.

    A store's close also runs from a collected publisher's finalizer, which the garbage collector
    runs in whatever thread allocates at that moment: inside this very lock too (a sweep
    allocating paths), where taking it again waits forever (CI of 2026-12-06: one worker held
    63 min). So letting go never waits (:meth:`free`): it frees the runs now if the lock is free,
    else hands them over in a ``queue.SimpleQueue`` (reentrant, made for finalizers), and whoever
    holds the lock next frees them before reading ``LIVE``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._freed: queue.SimpleQueue[Path] = queue.SimpleQueue()

    def __enter__(self) -> Guard:
        self._lock.acquire()
        self._drain()
        return self

    def __exit__(self, *exc: object) -> None:
        self._drain()
        self._lock.release()

    def free(self, run_dirs: list[Path]) -> None:
        """Take ``run_dirs`` out of ``LIVE`` now, or at the lock's next holder; never waits."""
        for run_dir in run_dirs:
            self._freed.put(run_dir)
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def after_fork(self) -> None:
        """In a forked child: another thread of the parent may have held the lock at the fork."""
        self._lock = threading.Lock()
        self._freed = queue.SimpleQueue()

    def _drain(self) -> None:
        while True:
            try:
                LIVE.discard(self._freed.get_nowait())
            except queue.Empty:
                return


GUARD = Guard()


def _forget_after_fork() -> None:
    """In a forked child: close its copies of the lock descriptors (the parent keeps its locks:
    a flock goes only with the last copy) and own nothing."""
    GUARD.after_fork()
    for fd in OWNED.values():
        try:
            os.close(fd)
        except OSError:
            pass
    OWNED.clear()
    LIVE.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
