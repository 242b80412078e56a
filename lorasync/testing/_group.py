"""A helper server started in a process group of its own (the router, the AIBrix sidecar): its
log file, and its stop, which ends the whole group (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from lorasync.errors import EngineTimeoutError, EngineUnavailableError
from lorasync.testing._ports import group_listens

__all__ = ["GroupProcess", "group_alive", "signal_group", "stop_group"]


def stop_group(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """End the process group ``proc`` leads: SIGTERM, then SIGKILL for whatever of it is left after
    ``timeout`` seconds (the leader may exit before its members: vLLM's engine core, a member that
    ignores SIGTERM)."""
    signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while (proc.poll() is None or group_alive(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is None or group_alive(proc.pid):
        signal_group(proc.pid, signal.SIGKILL)
        proc.wait(10.0)
        # killpg returns once the signal is sent, not once the members are gone: on a loaded host a
        # member may still run for a moment, and whoever stops a helper expects its ports and files
        # free when this returns.
        deadline = time.monotonic() + 10.0
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid``; a group that is gone is no error."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still runs. A zombie (killed, not yet reaped: an
    orphan waits for whoever reaps them, which in a container may be never) does not count."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        names = os.listdir("/proc")
    except OSError:
        return True  # no /proc to tell zombies apart: the signal says someone is there
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after the command, which may hold spaces
        except OSError:
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and (fields[0] != b"Z" or _threads_run(name)):
            return True
    return False


def _threads_run(pid: str) -> bool:
    """Whether a process whose leader thread is a zombie still runs other threads (its main thread
    exited with ``pthread_exit`` while workers go on: ``/proc/<pid>/stat`` then says ``Z``)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in (b"Z", b"X"):
            return True
    return False


class GroupProcess:
    """What a started helper keeps: ``_proc`` (its group's leader), ``_log`` (the open log) and
    ``log_path``. Subclasses start it (``start_new_session=True``) and may release more in
    :meth:`_stopped`."""

    log_path: Path | None = None
    _proc: subprocess.Popen[bytes] | None = None
    _log: Any = None

    def start(self) -> Any:  # pragma: no cover - every subclass starts its own process
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> None:
        """Stop its whole process group: SIGTERM, then SIGKILL for whatever of the group is left
        after ``timeout`` seconds (the leader may exit before a member that ignores SIGTERM).
        Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_group(proc, timeout)
        if self._log is not None:
            self._log.close()
            self._log = None
        self._stopped()

    def _stopped(self) -> None:
        """Hook: release what the subclass holds beside the process."""

    def _wait_ready(self, what: str, url: str, port: int, timeout: float, ready: Callable[[httpx.Client], bool], *, poll: float = 0.1, waiting_for: str = "ready") -> None:
        """Wait until the started group listens on ``port`` and ``ready(client)`` says yes; stop the
        group on any failure (or a caller's interrupt) before raising.

        Raises:
            EngineUnavailableError: it exited during startup (its log says why).
            EngineTimeoutError: not ready within ``timeout`` seconds.
        """
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        try:
            with httpx.Client(timeout=2.0) as client:
                while True:
                    if self._proc.poll() is not None:
                        raise EngineUnavailableError(f"{what} exited during startup ({self._proc.returncode}); its log: {self.log_tail()}")
                    if group_listens(self._proc.pid, port) is not False:
                        try:
                            if ready(client):
                                return
                        except (httpx.HTTPError, ValueError, TypeError, KeyError, AttributeError):
                            pass  # not up yet, or not answering as it will (a body of another shape)
                    if time.monotonic() > deadline:
                        raise EngineTimeoutError(f"{what} at {url} was not {waiting_for} within {timeout:.0f} s; its log: {self.log_tail()}")
                    time.sleep(poll)
        except BaseException:
            self.stop()
            raise

    def log_text(self) -> str:
        """Everything it has logged so far."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
