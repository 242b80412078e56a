"""The README's first command, `bash scripts/bootstrap.sh`, as a user runs it: the real script,
with a `.venv/bin/python` that records what it is asked to do instead of installing (a real
install takes minutes and 1.6 GB; `scripts/test.sh` exercises the `--test` branch for real).
The user's branch installs lorasync with the TRL and bench extras and never the test extras
(DeepSpeed among them prints "Setting accelerator to CPU" in every script of a CPU user's)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

SHIM = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../calls.log"
exit 0
"""


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "bootstrap.sh", repo / "scripts" / "bootstrap.sh")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(SHIM)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    out = subprocess.run(["bash", "scripts/bootstrap.sh", *args], cwd=repo, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHON": "false"})
    log = repo / ".venv" / "calls.log"
    calls = log.read_text().splitlines() if log.exists() else []
    return out, calls


def test_the_users_setup_installs_no_test_extras(tmp_path: Path) -> None:
    out, calls = _run(tmp_path)
    assert out.returncode == 0, out.stderr
    installs = [c for c in calls if c.startswith("-m pip install -q -e ")]
    assert installs == ['-m pip install -q -e .[trl,bench] torch==2.13.0'], calls
    assert "test" not in installs[0]


def test_the_test_command_adds_the_test_extras(tmp_path: Path) -> None:
    out, calls = _run(tmp_path, "--test")
    assert out.returncode == 0, out.stderr
    assert [c for c in calls if c.startswith("-m pip install -q -e ")] == ['-m pip install -q -e .[trl,bench,test] torch==2.13.0'], calls


@pytest.mark.parametrize("arg", ["--tests", "test", "-t"])
def test_a_mistyped_option_is_refused_before_anything_installs(tmp_path: Path, arg: str) -> None:
    out, calls = _run(tmp_path, arg)
    assert out.returncode == 2 and "usage: bash scripts/bootstrap.sh [--test]" in out.stderr
    assert calls == []
