"""``lorasync bench regression``: an earlier revision of lorasync runs beside this checkout's, as
its own package, and the publish case compares the two on the same tensors. No timing assertions.

The baseline is loaded in a subprocess: a second copy of the package must not enter the test
process's ``sys.modules``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._baseline import checkout_root

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(checkout_root() is None, reason="no test can: the baseline comes from git history, and this is no checkout")

_SCRIPT = r"""
import json, re, sys, tempfile
from pathlib import Path
import lorasync
from benchmarks._baseline import load_baseline
from benchmarks._harness import Options, Report
from benchmarks.regression import _publish_case

base, sha = load_baseline("HEAD", Path(sys.argv[1]))
own = re.compile(r"^\s*(?:import|from)\s+lorasync(?:\.|\s|$)", re.MULTILINE)
offenders = [str(p) for p in Path(sys.argv[1], "lorasync_base").rglob("*.py") if own.search(p.read_text())]
report = Report("regression", "t")
_publish_case(Options(quick=True, repeats=2, warmup=0, shapes=["tiny"], ranks=[4], progress=False, root=Path(sys.argv[2])), report, {"base": base, "head": lorasync}, Path(sys.argv[2]))
print(json.dumps({
    "sha": sha,
    "base_module": base.Publisher.__module__,
    "head_module": lorasync.Publisher.__module__,
    "distinct": base.Publisher is not lorasync.Publisher and base.Adapter is not lorasync.Adapter,
    "offenders": offenders,
    "goals": [[g.name, g.value] for g in report.goals],
    "rounds": {k: len(v) for k, v in report.data["publish"]["every_step"].items()},
    "left": sorted(p.name for p in Path(sys.argv[2]).iterdir()),
}))
"""


def test_the_baseline_is_its_own_package_and_the_publish_case_compares_both(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "baseline"), str(scratch)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert out["sha"] == head
    assert out["base_module"].startswith("lorasync_base.") and out["head_module"].startswith("lorasync.")
    assert out["distinct"] and out["offenders"] == []
    assert [name for name, _ in out["goals"]] == [
        "publish: every-step publish (keep=2), this checkout / baseline (CPU time)",
        "publish: fresh Publisher, first publish, this checkout / baseline (CPU time)",
    ]
    assert all(value > 0 for _, value in out["goals"])
    assert out["rounds"] == {"base": 2, "head": 2}
    assert out["left"] == []  # the case's stores are removed


def test_an_unknown_revision_is_a_skipped_report_saying_so(tmp_path):
    from lorasync.cli import main

    code = main(["bench", "regression", "--against", "no-such-revision-xyz", "--out", str(tmp_path), "--no-progress", "--no-plot"])
    assert code == 0
    data = json.loads((tmp_path / "regression.json").read_text())
    assert "no-such-revision-xyz" in data["skipped"]
