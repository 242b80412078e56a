"""An earlier revision of lorasync, importable beside this checkout's, for the regression benchmark.

``git archive`` takes the ``lorasync/`` package of that revision out of this checkout's history
into a temporary folder, renamed ``lorasync_base`` (its own imports rewritten), so both versions
run in one process on the same tensors, engine and box, interleaved operation by operation: the
only comparison that stays honest on a shared machine, where absolute times of runs made on
different days move by tens of percent.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path
from types import ModuleType

__all__ = ["BASE_PACKAGE", "checkout_root", "load_baseline"]

BASE_PACKAGE = "lorasync_base"
# `import lorasync`, `from lorasync import`, `lorasync.x` (also in lazy registry targets such as
# "lorasync.engines.vllm:VLLMEngine"); never prose such as "what lorasync refuses".
_IMPORTS = re.compile(r"(?<![\w.])lorasync(?=\.\w|\s+import\b|\s*$)|(?<=import )lorasync\b", re.MULTILINE)


def checkout_root() -> Path | None:
    """The git checkout this ``benchmarks`` package sits in (None: an installed wheel)."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / ".git").exists() else None


def load_baseline(rev: str, into: Path) -> tuple[ModuleType, str]:
    """Extract ``lorasync/`` of ``rev`` under ``into`` as ``lorasync_base`` and import it.

    Args:
        rev: a commit, tag or branch of this checkout.
        into: an empty folder that outlives the benchmark's use of the package.

    Returns:
        ``(package, full commit hash)``.

    Raises:
        RuntimeError: not a git checkout, ``rev`` unknown, or already loaded from another revision.
    """
    root = checkout_root()
    if root is None:
        raise RuntimeError("the regression benchmark needs a git checkout of lorasync (it takes the older revision from its history)")
    found = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", f"{rev}^{{commit}}"], capture_output=True, text=True)
    if found.returncode != 0:
        raise RuntimeError(f"no commit {rev!r} in {root}: {found.stderr.strip()}")
    sha = found.stdout.strip()
    if BASE_PACKAGE in sys.modules:
        loaded = getattr(sys.modules[BASE_PACKAGE], "__baseline_commit__", None)
        if loaded != sha:
            raise RuntimeError(f"{BASE_PACKAGE} is already loaded from {loaded}; run one baseline per process")
        return sys.modules[BASE_PACKAGE], sha
    archive = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", sha, "lorasync"], capture_output=True, check=True)
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    package = into / BASE_PACKAGE
    (into / "lorasync").rename(package)
    for source in package.rglob("*.py"):
        text = source.read_text(encoding="utf-8")
        source.write_text(_IMPORTS.sub(BASE_PACKAGE, text), encoding="utf-8")
    sys.path.insert(0, str(into))
    try:
        module = importlib.import_module(BASE_PACKAGE)
    finally:
        sys.path.remove(str(into))
    module.__baseline_commit__ = sha  # type: ignore[attr-defined]
    return module, sha
