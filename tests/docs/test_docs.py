"""Every code block of README.md and docs/**/*.md runs here, so the docs cannot rot.

New files under docs/ are picked up automatically. One test per fenced block, named
``FILE:LINE``. What a block's info string means:

* ``python``: executed; the python blocks of one file share one namespace, in order (a page reads
  top to bottom). The namespace starts with a small real training context, so snippets can say
  what a trainer has: ``peft_model`` (the tiny local Llama with a PEFT LoRA, on CPU),
  ``train_step()`` (one Adam step on it, returns the loss), ``prompt_ids``, ``step``/``steps``,
  ``rank`` (0), ``base_dir`` (the tiny base checkpoint).
* ``bash``/``sh``/``shell``: executed with ``bash -euo pipefail`` from the repository root,
  ``.venv/bin/`` meaning this test's Python environment, ``/tmp/`` a fresh temp directory and
  port 8000 a free port (so a server a block starts collides with nothing); whatever the block
  leaves running is killed with its process group.
  A block that installs packages (``pip install``) or runs the tests (``pytest``,
  ``scripts/test.sh``) fails instead of running: it would change the suite's own environment
  or run the suite inside itself, so it must be marked ``skip``.
* ``toml``/``json``: parsed. ``text``: not code (output, diagrams). A fence with no language
  fails: say ``text`` when it is not code.

Markers, an HTML comment on the line right before the fence (visible in the doc source):

* ``<!-- docs-test: skip: REASON -->``: not run; the reason is required and shows in the test
  report. For setup commands the test command itself runs, and for hardware CI lacks.
* ``<!-- docs-test: vllm -->``: runs against the session's real vLLM CPU server
  (tests/conftest.py, served model ``tiny-base`` on the tiny model);
  ``http://127.0.0.1:8000`` in the block means that server, and every adapter is unloaded from
  it after the block.

In every block ``/models/base`` means the tiny base checkpoint, and the disk transport's default
root is the block's own temp dir (tests never write to the shared ``/dev/shm/lorasync``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)[^`]*$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
RUN_PYTHON = {"python", "py", "pycon"}
RUN_BASH = {"bash", "sh", "shell"}
PARSE = {"toml", "json"}
NOT_CODE = {"text"}
VLLM_URL = "http://127.0.0.1:8000"


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    code: str
    markers: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, start = match["fence"], i
        markers = []
        j = i - 1
        while j >= 0 and MARKER.match(lines[j]):
            markers.insert(0, MARKER.match(lines[j])["body"])  # type: ignore[index]
            j -= 1
        body = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence[0] * len(fence)) and not lines[i].strip().strip(fence[0])):
            body.append(lines[i])
            i += 1
        out.append(Block(path, start + 1, match["info"].lower(), textwrap.dedent("\n".join(body)) + "\n", markers))
        i += 1
    return out


BLOCKS = [b for path in doc_files() for b in blocks_of(path)]


def _param(block: Block) -> Any:
    # Blocks that need the real vLLM carry the suite's `vllm` mark: `-m "not vllm"` skips them.
    needs_vllm = any(m.strip() == "vllm" for m in block.markers) or "vllm.entrypoints" in block.code
    return pytest.param(block, id=block.id, marks=[pytest.mark.vllm] if needs_vllm else [])


def _marker(block: Block, name: str) -> str | None:
    for m in block.markers:
        head, _, rest = m.partition(":")
        if head.strip() == name:
            return rest.strip()
    return None


def test_harness_finds_the_docs() -> None:
    files = {b.path.name for b in BLOCKS}
    assert {"README.md", "getting-started.md", "recipes.md"} <= files
    assert sum(b.lang in RUN_PYTHON for b in BLOCKS) >= 10


# -- the training context python blocks start with ---------------------------------------------


@pytest.fixture(scope="session")
def namespaces() -> dict[Path, dict[str, Any]]:
    return {}


def _context(base_dir: Path) -> dict[str, Any]:
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    from lorasync.testing import make_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = make_peft_model(AutoModelForCausalLM.from_pretrained(str(base_dir)), seed=7, std=0.02)
    optim = torch.optim.Adam([p for n, p in model.named_parameters() if "lora_" in n], lr=1e-3)
    ids = torch.tensor([[11, 42, 77, 105, 300, 200, 201, 202]])

    def train_step(*_: Any, **__: Any) -> float:
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        model.eval()
        return float(loss.detach())

    return {"peft_model": model, "train_step": train_step, "prompt_ids": [11, 42, 77], "step": 1, "steps": 3, "rank": 0, "base_dir": str(base_dir)}


def _substitute(code: str, *, base_dir: Path, tmp: Path, vllm_url: str | None) -> str:
    code = code.replace("/models/base", str(base_dir))
    if vllm_url is not None:
        code = code.replace(VLLM_URL, vllm_url)
    return code


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_doc_block(block: Block, request: pytest.FixtureRequest, namespaces: dict[Path, dict[str, Any]], tmp_path: Path) -> None:
    skip = _marker(block, "skip")
    if skip is not None:
        if not skip:
            pytest.fail(f"{block.id}: 'docs-test: skip' needs a reason: <!-- docs-test: skip: WHY -->")
        pytest.skip(f"{block.id}: {skip}")
    if not block.lang:
        pytest.fail(f"{block.id}: a fence without a language; write ```python/```bash to run it or ```text when it is not code")
    if block.lang in NOT_CODE:
        return
    if block.lang == "toml":
        tomllib = pytest.importorskip("tomllib")  # Python 3.11+
        tomllib.loads(block.code)
        return
    if block.lang == "json":
        json.loads(block.code)
        return
    if block.lang not in RUN_PYTHON | RUN_BASH:
        pytest.fail(f"{block.id}: language {block.lang!r} is neither run nor parsed; use python, bash, toml, json or text")
    base_dir = request.getfixturevalue("tiny_model_dir")
    vllm_url = None
    if _marker(block, "vllm") is not None:
        vllm_url = request.getfixturevalue("vllm_server").url
    code = _substitute(block.code, base_dir=base_dir, tmp=tmp_path, vllm_url=vllm_url)
    # Tests never write to the shared default store root (/dev/shm/lorasync): blocks that use
    # the default root get this block's temp dir.
    store = pytest.importorskip("lorasync.transports._store")
    if hasattr(store, "default_root"):
        request.getfixturevalue("monkeypatch").setattr(store, "default_root", lambda: tmp_path / "store")
    try:
        if block.lang in RUN_PYTHON:
            ns = namespaces.setdefault(block.path, {"__name__": f"docs_{block.path.stem}", **_context(base_dir)})
            exec(compile(code, block.id, "exec"), ns)  # noqa: S102 - the docs are this repo's own
        else:
            _run_bash(block, code, tmp_path)
    finally:
        if vllm_url is not None:
            _reset_engine(vllm_url)


def _reset_engine(url: str) -> None:
    """Unload what a block loaded: every block starts from an engine serving no adapter (blocks
    reuse names like ``policy``, whose versions never go back on one engine)."""
    from lorasync.engines import connect

    engine = connect("vllm", url, timeout=120)
    try:
        for served in engine.list_adapters():
            engine.unload_adapter(served)
    finally:
        engine.close()


INSTALLS = re.compile(r"(^|[\s;&|(])(pip|pip3|uv)\s+(install|uninstall)\b|-m\s+pip\s+(install|uninstall)\b")


RUNS_TESTS = re.compile(r"-m\s+pytest\b|(^|[\s;&|(])pytest\s|scripts/test\.sh")


def _run_bash(block: Block, code: str, tmp: Path) -> None:
    from lorasync.testing.vllm_server import free_port

    if INSTALLS.search(code):
        # It would change the environment the suite itself runs in.
        pytest.fail(f"{block.id} installs packages; mark it <!-- docs-test: skip: installs into the environment -->")
    if RUNS_TESTS.search(code):
        pytest.fail(f"{block.id} runs the test suite inside the test suite; mark it <!-- docs-test: skip: runs tests that CI runs anyway -->")

    bindir = Path(sys.executable).parent
    port = str(free_port())  # a server a block starts never collides with another one
    # /tmp/ first, and only where the block itself writes it: the checkout (and so bindir) may
    # live under /tmp too.
    code = re.sub(r"(?<![\w./-])/tmp/", f"{tmp}/", code).replace(".venv/bin/", f"{bindir}/")
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace("--port 8000", f"--port {port}")
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(REPO)}
    # Own process group: whatever the block leaves running (a server after a failed step) is
    # killed with it.
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, f"{block.id} exited {proc.returncode}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
