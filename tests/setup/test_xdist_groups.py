"""The suite's two pytest-xdist workers (scripts/test.sh), as tests/conftest.py sets them up, on a
small project of its own: a file's tests run on one worker, the Ray files share one, and the
reliability figures a worker measured reach the table even when that worker dies afterwards, and a
dead worker ends the run failed (``--max-worker-restart 0``, as scripts/test.sh runs it)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

LOGGED = """import os, time

def _log(request):
    with open(os.environ["RANLOG"], "a") as out:
        out.write(os.environ["PYTEST_XDIST_WORKER"] + " " + request.node.nodeid + "\\n")

""" + "".join(f"def test_{i}(request):\n    time.sleep(0.2)\n    _log(request)\n\n" for i in range(5))

FIGURES = """import os
from reliability._figures import record

def test_kills_a():
    record(kills=3)

def test_kills_b():
    record(kills=4)

def test_then_the_worker_dies():
    os._exit(1)
"""


def test_files_stay_on_one_worker_and_figures_survive_a_dead_worker(tmp_path: Path) -> None:
    project = tmp_path / "project"
    files = {
        "tests/engines/test_ray_engine.py": LOGGED,  # the "ray" group of tests/conftest.py
        "tests/fleet/test_fleet_ray.py": LOGGED,
        "tests/a/test_one.py": LOGGED,
        "tests/b/test_two.py": LOGGED,
        "tests/c/test_figures.py": FIGURES,
    }
    for name, text in files.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    (project / "tests" / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (project / "pytest.ini").write_text("[pytest]\ntestpaths = tests\n")
    log = tmp_path / "ran.log"
    env = {**os.environ, "PYTHONPATH": str(TESTS), "RANLOG": str(log)}  # reliability._figures from here
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "--max-worker-restart", "0", "-p", "no:cacheprovider"],
        cwd=project, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    out = done.stdout + done.stderr
    workers: dict[str, set[str]] = defaultdict(set)
    for line in log.read_text().splitlines():
        worker, nodeid = line.split(" ", 1)
        workers[nodeid.split("::")[0]].add(worker)
    assert {path: len(ran) for path, ran in workers.items()} == dict.fromkeys(list(files)[:4], 1), (workers, out)
    assert workers["tests/engines/test_ray_engine.py"] == workers["tests/fleet/test_fleet_ray.py"], workers
    assert "worker 'gw" in out and "crashed while running 'tests/c/test_figures.py::test_then_the_worker_dies'" in out, out
    assert done.returncode == 1, out  # a dead worker fails the run (and ends it: no hang)
    rows = [line for line in out.splitlines() if line.startswith("SIGKILLs of a publishing process")]
    assert rows and rows[0].split()[-1] == "7", out  # 3 + 4, from the worker that died afterwards
