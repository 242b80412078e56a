"""Spawning real torch.distributed ranks (gloo, CPU) for the distributed-publish tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from support import spawn_ranks as _spawn


@pytest.fixture(scope="session")
def spawn_ranks() -> Callable[..., float]:
    """``spawn_ranks(fn, args, nprocs=, out=, deadline_s=)``: see :func:`support.spawn_ranks`."""
    return _spawn
