"""A helper server started in a process group of its own (the router, the AIBrix sidecar): its
log file, and its stop, which ends the whole group (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

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
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
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
