"""What a user's setup prints that the user did not cause (issue 37).

``bash scripts/bootstrap.sh`` (the README's set-up) installs the library with its ``trl`` and
``bench`` extras only; ``--test`` (``scripts/test.sh``, ``scripts/test-fast.sh``) adds the test
extras. DeepSpeed is one of them: installed, it prints "[WARNING] ... Setting accelerator to CPU"
whenever transformers is imported on a machine without a GPU, in every script of the user's.

The suite itself runs with the test extras, so the user's environment is rebuilt here without
them: a venv that sees this one's packages except the distributions only the test extras bring
(:func:`users_python`). The commands then run in it as a user types them.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BANNER = "setting accelerator to cpu"


def _extras(variable: str) -> list[str]:
    """The extras ``scripts/bootstrap.sh`` installs, from its ``VARIABLE="a,b"`` line."""
    match = re.search(rf'^{variable}="([\w,]+)"$', (REPO / "scripts" / "bootstrap.sh").read_text(), re.M)
    assert match, f"scripts/bootstrap.sh sets no {variable}"
    return match[1].split(",")


def _requirements(extras: list[str]) -> list[str]:
    """lorasync's own requirements plus those of ``extras`` (pyproject.toml)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *(r for extra in extras for r in project["optional-dependencies"][extra])]


def _closure(requirements: list[str]) -> set[str]:
    """The installed distributions ``requirements`` pull in, transitively (extras of dependencies
    not followed: pip installs none that nobody asked for)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                todo.append(sub)
    return seen


def _top_level(names: set[str]) -> set[str]:
    """The site-packages entries (packages, modules, dist-info folders) of the distributions ``names``."""
    out: set[str] = set()
    for name in names:
        for file in importlib.metadata.distribution(name).files or []:
            if file.parts and file.parts[0] != "..":
                out.add(file.parts[0])
    return out


def test_the_users_setup_installs_no_test_extras() -> None:
    user, test = _closure(_requirements(_extras("USER_EXTRAS"))), _closure(_requirements(_extras("TEST_EXTRAS")))
    assert "test" not in _extras("USER_EXTRAS") and "test" in _extras("TEST_EXTRAS")
    if "deepspeed" not in test:
        pytest.skip("deepspeed is not installed here; nothing to tell apart")
    assert "deepspeed" not in user, "something the user's set-up installs pulls in deepspeed"
    # The README's set-up command is the plain one; the test commands ask for the test extras.
    assert "bash scripts/bootstrap.sh && .venv/bin/lorasync demo" in (REPO / "README.md").read_text()
    for script in ("test.sh", "test-fast.sh"):
        assert "scripts/bootstrap.sh --test" in (REPO / "scripts" / script).read_text(), script


def users_python(folder: Path) -> Path:
    """A venv that sees this one's site-packages, less what only the test extras install: what
    ``bash scripts/bootstrap.sh`` alone gives a user (built of links in seconds, nothing installed)."""
    user = _closure(_requirements(_extras("USER_EXTRAS")))
    test_only = _closure(_requirements(_extras("TEST_EXTRAS"))) - user
    hidden = _top_level(test_only) - _top_level(user)  # a namespace folder both share stays
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(folder)], check=True)  # type: ignore[attr-defined]
    python = folder / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if entry.name not in hidden:
            (site / entry.name).symlink_to(entry)
    return python


def _run(command: list[str], tmp_path: Path) -> str:
    temp = tmp_path / "temp"
    temp.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONWARNINGS": "default"}  # every warning once, as a first run shows it
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False, env=env, cwd=tmp_path)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    return text


def test_make_base_prints_no_banner_even_where_deepspeed_is_installed(tmp_path: Path) -> None:
    # getting-started's `.venv/bin/lorasync demo --make-base /tmp/tiny`, in this (test) environment.
    cli = Path(sys.executable).parent / "lorasync"
    if not cli.exists():
        pytest.skip(f"no console script at {cli} (lorasync not installed in this venv)")
    text = _run([str(cli), "demo", "--make-base", str(tmp_path / "tiny")], tmp_path)
    assert "tiny base model written to" in text, text
    for noise in (BANNER, "warning", "traceback"):
        assert noise not in text.lower(), text


def test_the_readme_trl_snippet_prints_no_banner_and_no_warning_of_lorasyncs(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "tests" / "docs"))
    from _blocks import blocks_of

    snippet = next(b for b in blocks_of(REPO / "README.md") if "LoraSyncCallback" in b.code and b.lang == "python")
    (tmp_path / "snippet.py").write_text(snippet.code)
    text = _run([str(users_python(tmp_path / "venv")), "snippet.py"], tmp_path)
    assert BANNER not in text.lower(), text
    # TRL 1.16 with transformers 5.x warns on its own (SFTConfig's `gradient_checkpointing`, and
    # peft's read of `is_gradient_checkpointing` when SFTTrainer wraps the model): theirs, shown
    # as they are. None may come from lorasync's code.
    import lorasync

    package = str(Path(lorasync.__file__).resolve().parent)
    ours = [line for line in text.splitlines() if re.search(r"\w*Warning:", line) and line.startswith(package)]
    assert ours == [], text
