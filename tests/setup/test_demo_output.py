"""``lorasync demo`` as a new user first runs it (the console script, a fresh process, so import-
time banners count): it succeeds and prints no traceback and no warning. Third-party noise it
used to print: deepspeed's "Setting accelerator to CPU" banner and transformers' FutureWarning
about is_gradient_checkpointing (read by peft)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_prints_no_warning_and_no_traceback() -> None:
    cli = Path(sys.executable).parent / "lorasync"
    done = subprocess.run([str(cli), "demo", "--steps", "2"], capture_output=True, text=True, timeout=600, check=False)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    assert "all engines serve exactly the trained weights" in done.stdout, text
    for noise in ("warning", "traceback", "setting accelerator"):
        assert noise not in text.lower(), text
