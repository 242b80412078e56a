"""Run a function on N CPU processes joined by a gloo process group, with a hard deadline.

Tests use it to drive real torch.distributed collectives (FSDP1, FSDP2, DDP) without a GPU.
A hung collective must fail the test, not hang the suite: the group has a timeout and the
parent kills every child when the deadline passes.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["free_port", "run_distributed"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(
    rank: int, fn: Callable[..., None], world_size: int, port: int, timeout_s: float, args: tuple[Any, ...]
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # two processes share a 2-core box
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., None], *args: Any, world_size: int = 2, timeout_s: float = 240) -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    ``fn`` must be importable by name (a module-level function). Raises the first child's
    exception (``ProcessRaisedException`` carries its traceback) or ``TimeoutError`` after
    ``timeout_s`` seconds, having killed every child.
    """
    ctx = mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), timeout_s / 2, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed run of {fn.__name__} exceeded {timeout_s}s (hung collective?)")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join()
