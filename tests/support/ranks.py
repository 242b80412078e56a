"""One runner for every test that needs real torch.distributed ranks (gloo on CPU, NCCL on GPUs).

A hung collective must fail the test, not hang the suite: every run has a deadline, after which
the runner kills the processes it started (and only those).
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lorasync.testing.vllm_server import free_port

__all__ = ["run_distributed", "spawn_ranks"]


def spawn_ranks(
    fn: Callable[..., None], args: tuple[Any, ...], *, nprocs: int, out: Path | str | None = None, deadline_s: float
) -> float:
    """Run ``fn(rank, nprocs, port, *args)`` on ``nprocs`` spawned processes.

    Args:
        fn: a module-level function (spawned children import it by name); it sets up its own
            process group on ``127.0.0.1:port``.
        args: passed after ``(rank, nprocs, port)``.
        nprocs: number of ranks.
        out: where ranks write ``error-<rank>.txt`` on failure; shown when a rank fails.
        deadline_s: wall-clock limit of the whole run.

    Returns:
        `float`: the wall time in seconds.
    """
    import importlib

    import torch.multiprocessing as mp

    # The module, not the attribute: torch.multiprocessing.spawn is also the spawn() function.
    process_exception = importlib.import_module("torch.multiprocessing.spawn").ProcessException
    start = time.monotonic()
    ctx = mp.start_processes(fn, args=(nprocs, free_port(), *args), nprocs=nprocs, join=False, start_method="spawn")
    try:
        while not ctx.join(timeout=max(0.1, min(1.0, deadline_s - (time.monotonic() - start)))):
            if time.monotonic() - start > deadline_s:
                pytest.fail(f"the {nprocs} ranks of {fn.__name__} did not finish in {deadline_s} s (hung collective?)")
    except process_exception as exc:  # a rank raised or died
        errors = "\n".join(p.read_text() for p in sorted(Path(out).glob("error-*.txt"))) if out is not None else ""
        pytest.fail(f"a rank of {fn.__name__} failed:\n{errors or exc}")
    finally:
        for process in ctx.processes:  # only the processes this runner started
            if process.is_alive():
                process.kill()
                process.join()
    return time.monotonic() - start


def _gloo_entry(rank: int, world_size: int, port: int, fn: Callable[..., None], timeout_s: float, args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # the ranks share a small box
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., None], *args: Any, world_size: int = 2, timeout_s: float = 240) -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined by a gloo
    group (timeout half the deadline, so a hung collective raises inside the ranks first)."""
    spawn_ranks(_gloo_entry, (fn, timeout_s / 2, args), nprocs=world_size, deadline_s=timeout_s)
