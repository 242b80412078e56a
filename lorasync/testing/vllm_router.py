"""Start and stop vLLM's own router (``vllm-router`` on PyPI) in front of vLLM servers, for tests,
demos and benchmarks.

The router runs from the trainer's environment (its console script beside this Python, or on
``PATH``), in its own process group, on a port it is shown to hold (``_ports.group_listens``)
before it counts as started, and is ready once it lists every worker it was given.

Example:
    >>> with VLLMRouterProcess([a.url, b.url]) as router:  # doctest: +SKIP
    ...     pub = Publisher([f"vllm-router:{router.url}"], name="policy")
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from lorasync.errors import ConfigError
from lorasync.testing._group import GroupProcess
from lorasync.testing.vllm_server import free_port

__all__ = ["VLLMRouterProcess", "router_binary"]


def router_binary() -> str:
    """The ``vllm-router`` console script of this environment.

    Raises:
        ConfigError: it is not installed (``pip install vllm-router``).
    """
    beside = Path(sys.executable).parent / "vllm-router"
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        raise ConfigError("vllm-router is not installed in this environment: pip install vllm-router (bootstrap.sh --test installs it)")
    return found


class VLLMRouterProcess(GroupProcess):
    """One ``vllm-router`` process.

    Args:
        workers: the vLLM servers' URLs (``--worker-urls``).
        policy (`str`): the routing policy; ``round_robin`` sends consecutive requests to every
            worker in turn, which is what a test of "every worker serves it" needs.
        port (`int`, *optional*): default a free one.
        health_check_interval (`int`): seconds between the router's checks of its workers (a
            restarted worker gets traffic again after a few of them).
        log_path: where its output goes (default a temporary file).
        startup_timeout (`float`): seconds to wait until it lists every worker.
        prometheus_port (`int`, *optional*): where its metrics exporter listens; default a free
            port picked at each start (the router's own default, 29000, lets one router per host).
    """

    def __init__(
        self,
        workers: Sequence[str],
        *,
        policy: str = "round_robin",
        host: str = "127.0.0.1",
        port: int | None = None,
        health_check_interval: int = 1,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout: float = 120.0,
        prometheus_port: int | None = None,
    ) -> None:
        self.workers = [str(w).rstrip("/") for w in workers]
        self.policy = policy
        self.host = host
        self.port = port or free_port(host)
        self._given_prometheus_port = prometheus_port
        self.prometheus_port = prometheus_port
        self.health_check_interval = health_check_interval
        self.log_path = Path(log_path) if log_path is not None else None
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            router_binary(),
            "--host", self.host,
            "--port", str(self.port),
            "--policy", self.policy,
            "--worker-urls", *self.workers,
            "--health-check-interval-secs", str(self.health_check_interval),
            "--worker-startup-check-interval", "1",
            # Its metrics exporter binds a fixed port by default (29000): a second router on the
            # host then panics at start ("Address already in use"). One free port of its own each.
            "--prometheus-host", self.host,
            "--prometheus-port", str(self.prometheus_port or free_port(self.host)),
        ]  # fmt: skip

    def start(self) -> VLLMRouterProcess:
        """Start the router; returns once it listens and lists every worker.

        Raises:
            EngineUnavailableError: it exited (its log says why). EngineTimeoutError: not ready in time.
        """
        if self._proc is not None:
            return self
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-router-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.prometheus_port = self._given_prometheus_port or free_port(self.host)  # picked now, not at construction
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready("vllm-router", self.url, self.port, self.startup_timeout, self._lists_workers, poll=0.25, waiting_for="listing its workers")
        return self

    def _lists_workers(self, client: httpx.Client) -> bool:
        listed = client.get(f"{self.url}/list_workers").json().get("urls", [])
        return sorted(u.rstrip("/") for u in listed) == sorted(self.workers)
