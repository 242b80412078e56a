"""Spawning real torch.distributed ranks (gloo, CPU) for the distributed-publish tests."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spawn(fn: Callable[..., None], args: tuple[Any, ...], *, nprocs: int, out: Path, deadline_s: float) -> float:
    """Run ``fn(rank, nprocs, port, *args)`` on ``nprocs`` spawned ranks; fail the test (never
    hang) on a rank error or past ``deadline_s``. Returns the wall time."""
    import torch.multiprocessing as mp

    start = time.monotonic()
    ctx = mp.start_processes(fn, args=(nprocs, free_port(), *args), nprocs=nprocs, join=False, start_method="spawn")
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() - start > deadline_s:
                pytest.fail(f"the {nprocs} ranks did not finish in {deadline_s} s")
    except mp.ProcessException as exc:  # a rank raised or died
        errors = "\n".join(p.read_text() for p in sorted(out.glob("error-*.txt")))
        pytest.fail(f"a rank failed:\n{errors or exc}")
    finally:
        for process in ctx.processes:  # only the processes this helper started
            if process.is_alive():
                process.kill()
    return time.monotonic() - start


@pytest.fixture(scope="session")
def spawn_ranks() -> Callable[..., float]:
    """``spawn_ranks(fn, args, nprocs=, out=, deadline_s=)``: see :func:`_spawn`."""
    return _spawn
