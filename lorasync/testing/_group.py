"""A helper server started in a process group of its own (the router, the AIBrix sidecar): its
log file, and its stop, which ends the whole group (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["GroupProcess"]


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
        """Stop its process group (SIGTERM, then SIGKILL). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10.0)
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
