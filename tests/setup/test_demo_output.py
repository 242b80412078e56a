"""``lorasync demo`` as a new user first runs it (the console script, a fresh process, so import-
time banners count): it succeeds and prints no traceback and no warning. Third-party noise it
used to print: deepspeed's "Setting accelerator to CPU" banner and transformers' FutureWarning
about is_gradient_checkpointing (read by peft)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_demo_prints_no_warning_and_no_traceback(tmp_path_factory: pytest.TempPathFactory) -> None:
    cli = Path(sys.executable).parent / "lorasync"
    # Its own temp folder, to see that the demo leaves nothing there; not tmp_path, whose name (this
    # test's) holds the word "warning" the output is searched for.
    temp = tmp_path_factory.mktemp("demo-temp")
    env = {**os.environ, "TMPDIR": str(temp)}
    done = subprocess.run([str(cli), "demo", "--steps", "2"], capture_output=True, text=True, timeout=600, check=False, env=env)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    assert "all engines serve exactly the trained weights" in done.stdout, text
    for noise in ("warning", "traceback", "setting accelerator"):
        assert noise not in text.lower(), text
    # torch keeps its compile cache (torchinductor_<user>) in the temp folder on purpose; anything
    # else there the demo left behind.
    left = [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")]
    assert left == [], f"the demo left {left} in its temp folder"


def test_the_doc_helpers_cause_no_future_warning(tmp_path: Path) -> None:
    # Every doc snippet builds its trainer with make_peft_model; peft's get_peft_model read
    # transformers' deprecated is_gradient_checkpointing there and printed a FutureWarning. Shown
    # with -W default, as a user's first run shows it.
    repo = Path(__file__).resolve().parents[2]
    code = (
        "from lorasync.testing import make_peft_model, make_tiny_model\n"
        "from lorasync.testing._tiny_moe import make_moe_peft_model, make_tiny_moe_model\n"
        "make_peft_model(make_tiny_model())\nmake_moe_peft_model(make_tiny_moe_model())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(repo), "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "is_gradient_checkpointing" not in done.stderr, done.stderr
