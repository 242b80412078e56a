"""Start and stop AIBrix's runtime sidecar (``aibrix_runtime``, pip ``aibrix``) in front of a vLLM
server, for tests, demos and benchmarks.

The sidecar runs from its own venv (``scripts/aibrix-venv.sh``; its pins differ from lorasync's),
in its own process group, on a port it is shown to hold (``_ports.group_listens``) before it
counts as started, and is ready once ``/ready`` answers 200. It is given a private metrics folder:
it empties ``PROMETHEUS_MULTIPROC_DIR`` at start, which defaults to a folder every sidecar on the
host shares.

Example:
    >>> with AIBrixSidecar(vllm.url, python=aibrix_python) as sidecar:  # doctest: +SKIP
    ...     pub = Publisher([AIBrixEngine(vllm.url, sidecar=sidecar.url)], name="policy")
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from lorasync.testing._group import GroupProcess
from lorasync.testing.venvs import engine_venv
from lorasync.testing.vllm_server import free_port

__all__ = ["AIBrixSidecar"]


class AIBrixSidecar(GroupProcess):
    """One ``aibrix_runtime`` process driving the vLLM server at ``engine_url``.

    Args:
        engine_url (`str`): the vLLM server (``INFERENCE_ENGINE_ENDPOINT``).
        python (`str | os.PathLike`, *optional*): the AIBrix venv's python; default the one
            :func:`lorasync.testing.venvs.engine_venv` finds (``LORASYNC_AIBRIX_PYTHON``).
        api_key (`str`, *optional*): vLLM's key (``INFERENCE_ENGINE_API_KEY``).
        port (`int`, *optional*): default a free one, picked at each start.
        log_path: where its output goes (default a temporary file).
        startup_timeout (`float`): seconds to wait for ``/ready``.
    """

    def __init__(
        self,
        engine_url: str,
        *,
        python: str | os.PathLike[str] | None = None,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        self.engine_url = engine_url.rstrip("/")
        self.python = Path(python) if python is not None else engine_venv("aibrix").require()
        self.api_key = api_key
        self.host = host
        self._given_port = port
        self.port = port or free_port(host)
        self.log_path = Path(log_path) if log_path is not None else None
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self._metrics: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [str(self.python), "-m", "aibrix.app", "--host", self.host, "--port", str(self.port)]

    def start(self) -> AIBrixSidecar:
        """Start the sidecar; returns once it holds its port and answers ``/ready``.

        Raises:
            EngineUnavailableError: it exited (its log says why). EngineTimeoutError: not ready in time.
        """
        if self._proc is not None:
            return self
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="aibrix-sidecar-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.port = self._given_port or free_port(self.host)
        try:  # a start that fails half-way (no such python) leaves no folder and no open log
            self._metrics = tempfile.mkdtemp(prefix="aibrix-metrics-")
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "INFERENCE_ENGINE_API_KEY")}
            env.update(INFERENCE_ENGINE="vllm", INFERENCE_ENGINE_ENDPOINT=self.engine_url, PROMETHEUS_MULTIPROC_DIR=self._metrics)
            if self.api_key is not None:
                env["INFERENCE_ENGINE_API_KEY"] = self.api_key
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
            self._proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        except BaseException:
            self.stop()
            raise
        self._wait_ready("aibrix_runtime", self.url, self.port, self.startup_timeout, lambda client: client.get(f"{self.url}/ready").status_code == 200)
        return self

    def _stopped(self) -> None:
        if self._metrics is not None:
            shutil.rmtree(self._metrics, ignore_errors=True)
            self._metrics = None
