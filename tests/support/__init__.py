"""Helpers shared by the test folders (importable as ``support``: tests/conftest.py's folder is
on ``sys.path``).

* :func:`free_port`: a free TCP port on 127.0.0.1 (the one definition lives in
  ``lorasync.testing.vllm_server``, which plugin authors get too).
* :func:`spawn_ranks`: run ``fn(rank, nprocs, port, *args)`` on spawned ranks, failing the test
  (never hanging) on a rank error or past a deadline; ranks write ``error-<rank>.txt``.
* :func:`run_distributed`: the same, with a gloo process group set up around ``fn(rank, world, *args)``.
"""

from lorasync.testing.vllm_server import free_port
from .ranks import run_distributed, spawn_ranks

__all__ = ["free_port", "run_distributed", "spawn_ranks"]
