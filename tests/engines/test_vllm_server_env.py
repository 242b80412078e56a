"""The environment ``VLLMServer`` gives the engine (issue 25, item 8): lorasync importable, and
nothing else of the trainer's. Installed as a wheel, lorasync's parent folder is the trainer's
``site-packages``; putting it on the engine's ``PYTHONPATH`` handed the engine the trainer's
torch, transformers and numpy instead of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import lorasync

PACKAGE = Path(lorasync.__file__).resolve().parent


def _installed_like_a_wheel(tmp_path: Path) -> Path:
    """lorasync copied into a site-packages folder next to a 'transformers' of the trainer's."""
    site = tmp_path / "trainer" / "lib" / "site-packages"
    shutil.copytree(PACKAGE, site / "lorasync", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "transformers").mkdir()
    (site / "transformers" / "__init__.py").write_text("WHOSE = 'the trainer'\n")
    return site


CHECK = (
    "import lorasync, importlib.util, os;"
    "print(os.path.realpath(lorasync.__file__));"
    "t = importlib.util.find_spec('transformers');"
    "print(t is None or 'the trainer' not in open(t.origin).read());"
    "print(importlib.util.find_spec('strayed') is None)"
)

# Run by the wheel-installed lorasync: what VLLMServer.environment() gives, and what a Python
# started with it imports (while the process that made the environment, the trainer, lives).
LAUNCH = """
import json, os, subprocess, sys
sys.path.insert(0, sys.argv[1])
from lorasync.testing.vllm_server import VLLMServer
env = VLLMServer("unused", python=sys.executable).environment()
folder = env["PYTHONPATH"]
entries = sorted(os.listdir(folder)) if os.path.isdir(folder) else None
# -S: no site-packages of this interpreter, so only what PYTHONPATH names can be imported.
out = subprocess.run([sys.executable, "-S", "-c", sys.argv[2]], env={"PYTHONPATH": folder, "PATH": os.environ["PATH"]},
                     capture_output=True, text=True, timeout=120, cwd=sys.argv[3])
print(json.dumps({"pythonpath": folder, "entries": entries, "rc": out.returncode, "out": out.stdout.split(), "err": out.stderr[-2000:]}))
"""


def test_a_wheel_installed_lorasync_gives_the_engine_lorasync_alone(tmp_path: Path) -> None:
    import json

    site = _installed_like_a_wheel(tmp_path)
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "strayed.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(stray)}  # the trainer's own PYTHONPATH
    # Not from the repository: "-c" puts the working folder first on sys.path.
    done = subprocess.run([sys.executable, "-c", LAUNCH, str(site), CHECK, str(tmp_path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    paths = got["pythonpath"].split(os.pathsep)
    assert str(site) not in paths and str(stray) not in paths, paths
    assert len(paths) == 1 and got["entries"] == ["lorasync"], got
    assert got["rc"] == 0, got["err"]
    first, own_transformers, no_stray = got["out"]
    assert Path(first).resolve() == (site / "lorasync" / "__init__.py").resolve()  # the wheel's lorasync
    assert own_transformers == "True" and no_stray == "True"  # nothing else of the trainer's


def test_a_source_checkout_gives_the_engine_the_repository_root(tmp_path: Path) -> None:
    from lorasync.testing.vllm_server import VLLMServer

    env = VLLMServer("unused", python=sys.executable, env={"EXTRA": "x"}).environment()
    assert env["PYTHONPATH"] == str(PACKAGE.parent) and env["EXTRA"] == "x"
    added = VLLMServer("unused", python=sys.executable, env={"PYTHONPATH": str(tmp_path)}).environment()
    assert added["PYTHONPATH"].split(os.pathsep) == [str(PACKAGE.parent), str(tmp_path)]  # asked for: added


BUNDLE = """
import json, os, subprocess, sys
sys.path.insert(0, sys.argv[1])  # the bundle's folder, as PYTHONPATH=/tmp/site gives it on the GPU machine
import vllm  # the fake one there
from lorasync.testing.vllm_server import VLLMServer
same = VLLMServer("unused", python=sys.executable).environment()["PYTHONPATH"].split(os.pathsep)
other = VLLMServer("unused", python="/nonexistent/python3").environment()["PYTHONPATH"].split(os.pathsep)
print(json.dumps({"same": same, "other": other}))
"""


def test_the_engine_on_this_interpreter_sees_the_folder_vllm_came_from(tmp_path: Path) -> None:
    """On the GPU machine vLLM is installed into a folder of its own (scripts/gpu-vllm-bundle.sh,
    ``PYTHONPATH=/tmp/site``) and the server runs on the trainer's interpreter: it must see that
    folder (and no other of the trainer's), else it cannot import vLLM (issue 34, item 6). A server
    on another interpreter (the CPU engine venv) gets nothing of it."""
    import json

    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("__version__ = 'bundle'\n")
    out = subprocess.run([sys.executable, "-c", BUNDLE, str(site)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(PACKAGE.parent)))
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert str(site.resolve()) in seen["same"]
    assert str(site.resolve()) not in seen["other"]
