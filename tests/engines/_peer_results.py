"""A pytest plugin for the engine-venv peers: each test phase's outcome is appended to the file
``$LORASYNC_PEER_RESULTS`` as soon as it is known, so a peer that dies (SIGABRT, a dead engine
core) still tells which scenarios passed, and which one was running. Load it with
``-p tests.engines._peer_results``."""

from __future__ import annotations

import os
from typing import Any


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _write(nodeid, "started")


def pytest_runtest_logreport(report: Any) -> None:
    _write(report.nodeid, f"{report.when}-{report.outcome}")


def _write(nodeid: str, what: str) -> None:
    path = os.environ.get("LORASYNC_PEER_RESULTS")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"{nodeid.split('::', 1)[-1]} {what}\n")
