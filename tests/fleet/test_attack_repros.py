"""The outside attack on issue 33's last Fleet change (a reviewer who did not write it), each
repro run as it was handed over: a script a trainer could have written, which exits 1 when the
bug shows. Found and fixed:

* a round whose publish found the engines serving the bytes already (the trainer stepped away and
  back; a cancelled round's load that landed; a GPU adapter's device hash against the files'
  hash) moved the tenant to a version no engine served (``lorasync/fleet/_tenant.py: step``);
* a no-copy adapter whose storage the trainer freed (FSDP reshard) was published as zeros
  (``refuse_freed`` in ``lorasync/publisher/_digest.py``);
* a publish from an optimizer's step hook or closure (Lightning's training_step) was refused for
  ever as torn (the watch skips a step of the thread waiting in the publish).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPROS = Path(__file__).parent / "repros"
ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("script", sorted(p.name for p in REPROS.glob("*.py")))
def test_repro_holds(script: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, str(REPROS / script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    if out.returncode == 77:
        pytest.skip(f"{script}: needs a GPU")
    assert out.returncode == 0, f"{script} shows its bug again:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
