"""Every code block of README.md and docs/**/*.md runs here as written, so the docs cannot rot.

New files under docs/ are picked up automatically. One test per fenced block, named
``FILE:LINE``. Nothing is injected: a block runs with what it defines and imports itself, or
with what an earlier block it declares to continue left behind. What a block's info string means:

* ``python``: executed in this test's Python (the library venv, ``.venv``) with
  ``__name__ == "__main__"``, in a fresh namespace unless the block is marked ``continues``.
* ``bash``/``sh``/``shell``: executed with ``bash -euo pipefail`` from the repository root,
  ``.venv/bin/`` meaning this test's Python environment, ``/tmp/`` the page's own temp directory
  (shared by the page's bash and file blocks) and port 8000 a free port (so a server a block
  starts collides with nothing); whatever the block leaves running is killed with its process
  group. A block that installs packages (``pip install``) or runs the tests (``pytest``,
  ``scripts/test.sh``) fails instead of running: it would change the suite's own environment or
  run the suite inside itself, so it must be marked ``skip``.
* ``toml``/``json``: parsed. ``text``: not code (output, diagrams). A fence with no language
  fails: say ``text`` when it is not code.

Markers, HTML comments on the lines right before the fence (visible in the doc source):

* ``<!-- docs-test: skip: REASON -->``: not run. The reason shows in the report and must name the
  test that covers the block (``tests/...py``, optionally ``::test_name``; both are checked to
  exist) or say ``no test can: WHY``.
* ``<!-- docs-test: continues -->``: a python block that goes on where the nearest earlier
  running python block of the same page left off (its names, its objects), as a reader running
  the page top to bottom would. ``continues: NAME`` continues the block marked
  ``<!-- docs-test: name: NAME -->`` instead. Run alone, the test re-runs the blocks it continues.
* ``<!-- docs-test: file: /tmp/NAME -->``: the block is a file a later bash block runs; it is saved
  verbatim in the page's temp dir (python is compiled, not run, by its own test).
* ``<!-- docs-test: vllm -->``: runs against the session's real vLLM CPU server (tests/conftest.py,
  served model ``tiny-base``, the tiny model of ``lorasync.testing.make_tiny_model``):
  ``127.0.0.1:8000`` in the block means that server and ``/models/base`` the model directory it
  serves (the page says so); every adapter is unloaded from it after the block.
* ``<!-- docs-test: vllm-venv -->``: a bash block that runs the vLLM engine venv's python (the page
  says how); skipped without that venv like every vLLM test (``LORASYNC_REQUIRE_VLLM=1`` fails
  instead), with ``$LORASYNC_VLLM_PYTHON`` set to it.

In python blocks the disk transport's default root is the block's own temp dir (tests never
write to the shared ``/dev/shm/lorasync``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _blocks import NOT_CODE, REPO, RUN_BASH, RUN_PYTHON, Block, blocks_of, chain, doc_files, marker_problem, skip_problem  # noqa: E402

PAGES = {path: blocks_of(path) for path in doc_files()}
BLOCKS = [b for page in PAGES.values() for b in page]
VLLM_URL = "http://127.0.0.1:8000"


def _param(block: Block) -> Any:
    # Blocks that need the real vLLM carry the suite's `vllm` mark: `-m "not vllm"` skips them.
    # A block that starts a server itself (`vllm serve`, or the module it runs) needs one too.
    starts_vllm = "vllm.entrypoints" in block.code or re.search(r"\bvllm\S*\s+serve\b", block.code) is not None
    needs_vllm = any(block.marker(m) is not None for m in ("vllm", "vllm-venv")) or starts_vllm
    return pytest.param(block, id=block.id, marks=[pytest.mark.vllm] if needs_vllm else [])


def test_harness_finds_the_docs() -> None:
    files = {b.path.name for b in BLOCKS}
    assert {"README.md", "getting-started.md", "recipes.md", "vllm-inprocess.md"} <= files
    assert sum(b.runs_python for b in BLOCKS) >= 10


def test_skip_reasons_must_name_a_covering_test() -> None:
    assert skip_problem("") is not None
    assert "names no test" in (skip_problem("needs a GPU") or "")
    assert "does not exist" in (skip_problem("tests/engines/test_no_such_file.py runs it") or "")
    assert "has no test" in (skip_problem("tests/docs/test_docs.py::test_no_such_test runs it") or "")
    assert skip_problem("tests/docs/test_docs.py::test_doc_block runs it") is None
    assert skip_problem("needs a GPU; no test can: CI has none") is None


def test_continues_must_name_a_block_that_runs() -> None:
    def block(line: int, *markers: str) -> Block:
        return Block(REPO / "docs" / "page.md", line, "python", "x = 1\n", list(markers))  # never read

    skipped, setup = block(1, "skip: no test can: an example"), block(5, "name: setup")
    goes_on, named = block(9, "continues"), block(13, "continues: setup")
    assert "no earlier python block" in (marker_problem(goes_on, [skipped, goes_on]) or "")
    assert "no earlier block" in (marker_problem(named, [skipped, named]) or "")
    skipped_setup = block(1, "name: setup", "skip: tests/docs runs it")
    assert "does not run" in (marker_problem(named, [skipped_setup, named]) or "")
    assert marker_problem(goes_on, [skipped, setup, goes_on]) is None
    assert [b.line for b in chain(named, [setup, goes_on, named])] == [5, 13]
    assert [b.line for b in chain(goes_on, [setup, goes_on])] == [5, 9]
    assert "unknown marker" in (marker_problem(block(1, "skipp: x"), []) or "")


# -- running the blocks ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def namespaces() -> dict[str, dict[str, Any]]:
    """The namespace each python block left, by block id (continuing blocks share one)."""
    return {}


@pytest.fixture(scope="session")
def page_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Path]:
    return {}


def _page_dir(path: Path, page_dirs: dict[Path, Path], factory: pytest.TempPathFactory) -> Path:
    """The page's /tmp/, with the page's file blocks saved in it."""
    if path not in page_dirs:
        tmp = factory.mktemp(f"page-{path.stem}")
        for b in PAGES[path]:
            if (name := b.marker("file")) is not None and b.marker("skip") is None:
                (tmp / name.removeprefix("/tmp/")).write_text(b.code)
        page_dirs[path] = tmp
    return page_dirs[path]


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_doc_block(block: Block, request: pytest.FixtureRequest, namespaces: dict[str, dict[str, Any]], page_dirs: dict[Path, Path], tmp_path: Path) -> None:
    page = PAGES[block.path]
    problem = marker_problem(block, page)
    if problem:
        pytest.fail(f"{block.id}: {problem}")
    if (skip := block.marker("skip")) is not None:
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
    if block.marker("file") is not None:
        _page_dir(block.path, page_dirs, request.getfixturevalue("tmp_path_factory"))
        if block.lang in RUN_PYTHON:
            compile(block.code, block.id, "exec")
        return
    if block.lang in RUN_BASH:
        _run_bash(block, request, _page_dir(block.path, page_dirs, request.getfixturevalue("tmp_path_factory")))
        return
    # Tests never write to the shared default store root (/dev/shm/lorasync).
    store = pytest.importorskip("lorasync.transports._store")
    if hasattr(store, "default_root"):
        request.getfixturevalue("monkeypatch").setattr(store, "default_root", lambda: tmp_path / "store")
    blocks = chain(block, page)
    if any(b.marker("vllm") is not None for b in blocks):
        # Started (once per session) before tempfile is redirected below: the server keeps
        # files of its own in the temp folder it starts with, which must outlive this block.
        request.getfixturevalue("vllm_server")
    # The folders a block makes with tempfile.mkdtemp() (a reader's throwaway folders) land in
    # this test's tmp_path, which pytest cleans, not in the machine's /tmp. Only mkdtemp without
    # a dir is redirected, not tempfile.tempdir or TMPDIR: torch memoizes gettempdir() for its
    # caches, and servers a fixture starts must not inherit a folder that goes away.
    scratch = tmp_path / "mkdtemp"
    scratch.mkdir()
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(suffix: str | None = None, prefix: str | None = None, dir: str | None = None) -> str:  # noqa: A002 - tempfile's name
        return real_mkdtemp(suffix, prefix, str(scratch) if dir is None else dir)

    request.getfixturevalue("monkeypatch").setattr(tempfile, "mkdtemp", mkdtemp)
    ns = namespaces.get(blocks[-2].id) if len(blocks) > 1 else None
    if ns is None:  # run alone (or after a failure): first re-run what this block continues
        ns = {"__name__": "__main__"}
        for earlier in blocks[:-1]:
            _exec_python(earlier, ns, request)
    _exec_python(block, ns, request)
    namespaces[block.id] = ns


def _exec_python(block: Block, ns: dict[str, Any], request: pytest.FixtureRequest) -> None:
    code = block.code
    vllm_url = None
    if block.marker("vllm") is not None:
        server = request.getfixturevalue("vllm_server")
        vllm_url = server.url
        tiny = str(request.getfixturevalue("tiny_model_dir"))  # the base the harness's server serves
        code = code.replace(VLLM_URL, vllm_url).replace("/models/base", tiny).replace("/tmp/tiny", tiny)
    try:
        exec(compile(code, block.id, "exec"), ns)  # noqa: S102 - the docs are this repo's own
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


def _run_bash(block: Block, request: pytest.FixtureRequest, tmp: Path) -> None:
    from lorasync.testing.vllm_server import free_port

    code = block.code
    if INSTALLS.search(code):
        # It would change the environment the suite itself runs in.
        pytest.fail(f"{block.id} installs packages; mark it <!-- docs-test: skip: installs into the environment; tests/... covers it -->")
    if RUNS_TESTS.search(code):
        pytest.fail(f"{block.id} runs the test suite inside the test suite; mark it <!-- docs-test: skip: ... -->")

    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PYTHONPATH", None)  # a block that needs one sets it, as a reader would
    # What the block's programs make with tempfile goes to a short folder of this test's (vLLM and
    # Ray put sockets there: AF_UNIX paths stop at 107 bytes), removed with the process group.
    scratch = Path(tempfile.mkdtemp(prefix="lsdoc-"))
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    env["TMPDIR"] = str(scratch)
    if block.marker("vllm-venv") is not None:
        env["LORASYNC_VLLM_PYTHON"] = str(request.getfixturevalue("vllm_python"))
    port = str(free_port())  # a server a block starts never collides with another one
    # /tmp/ first, and only where the block itself writes it: the checkout (and so bindir) may
    # live under /tmp too.
    code = re.sub(r"(?<![\w./-])/tmp/", f"{tmp}/", code).replace(".venv/bin/", f"{bindir}/")
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace("--port 8000", f"--port {port}")
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


def test_the_recipes_publish_to_the_base_getting_started_leaves_serving() -> None:
    """A recipe block pasted after getting started finds its base: the folder getting-started's
    make-base writes and vLLM serves (a pasted GRPO block once named /models/base, which nothing made)."""
    import re

    docs = Path(__file__).parents[2] / "docs"
    made = re.findall(r"demo --make-base (\S+)", (docs / "getting-started.md").read_text())
    recipes = (docs / "recipes.md").read_text()
    used = set(re.findall(r'model="(/[^"]+)"', recipes))
    assert made and used and used <= set(made), (made, used)
