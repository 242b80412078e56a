"""The fenced blocks of README.md and docs/**/*.md, with the markers that say how each one runs.

Parsing and the marker rules live here; ``test_docs.py`` runs the blocks. The markers are
documented in ``test_docs.py``'s docstring.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)[^`]*$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
RUN_PYTHON = {"python", "py"}
RUN_BASH = {"bash", "sh", "shell"}
PARSE = {"toml", "json"}
NOT_CODE = {"text"}
KNOWN_MARKERS = {"skip", "continues", "name", "file", "vllm", "vllm-venv"}
# A skip reason names the test that covers the block (a path under tests/, optionally
# ::test_name) or says why no test can.
NAMED_TEST = re.compile(r"\btests/[\w./-]*[\w/](?:::[\w\[\]-]+)?")
NO_TEST = "no test can"


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

    def marker(self, name: str) -> str | None:
        """The value of marker ``name`` ("" for a bare marker), None when the block lacks it."""
        for m in self.markers:
            head, _, rest = m.partition(":")
            if head.strip() == name:
                return rest.strip()
        return None

    @property
    def runs_python(self) -> bool:
        """Executed as Python in the suite's own interpreter (not skipped, not a file)."""
        return self.lang in RUN_PYTHON and self.marker("skip") is None and self.marker("file") is None


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


def skip_problem(reason: str) -> str | None:
    """Why a skip reason is not good enough, or None. It must name an existing test (path, and
    ``::name`` when given) or say why no test can."""
    if not reason:
        return "'docs-test: skip' needs a reason: <!-- docs-test: skip: WHY; tests/... runs it -->"
    if NO_TEST in reason:
        return None
    named = NAMED_TEST.findall(reason)
    if not named:
        return f"the skip reason {reason!r} names no test (tests/...py, or say 'no test can: WHY')"
    for ref in named:
        file, _, test = ref.partition("::")
        target = REPO / file
        if not target.exists():
            return f"the skip reason names {file}, which does not exist"
        if test and not re.search(rf"\bdef {re.escape(test.split('[')[0])}\b", target.read_text()):
            return f"the skip reason names {ref}, but {file} has no test {test}"
    return None


def continued(block: Block, page: list[Block]) -> Block | None:
    """The block ``block`` continues: the one marked ``name: X`` for ``continues: X``, else the
    nearest earlier python block of the page that runs. Raises ValueError when there is none."""
    target = block.marker("continues")
    if target is None:
        return None
    earlier = page[: page.index(block)]
    if target:
        found = [b for b in earlier if b.marker("name") == target]
        if not found:
            raise ValueError(f"{block.id} continues {target!r}, but no earlier block on the page is marked <!-- docs-test: name: {target} -->")
        base = found[-1]
    else:
        running = [b for b in earlier if b.runs_python]
        if not running:
            raise ValueError(f"{block.id} continues, but no earlier python block on the page runs")
        base = running[-1]
    if not base.runs_python:
        raise ValueError(f"{block.id} continues {base.id}, which does not run (skipped or a file)")
    return base


def chain(block: Block, page: list[Block]) -> list[Block]:
    """``block`` and every block it continues, first one first."""
    out = [block]
    while (base := continued(out[0], page)) is not None:
        out.insert(0, base)
    return out


def marker_problem(block: Block, page: list[Block]) -> str | None:
    """What is wrong with the block's markers, or None."""
    for m in block.markers:
        head = m.partition(":")[0].strip()
        if head not in KNOWN_MARKERS:
            return f"unknown marker <!-- docs-test: {m} -->; known: {', '.join(sorted(KNOWN_MARKERS))}"
    skip = block.marker("skip")
    if skip is not None:
        return skip_problem(skip)
    if block.marker("continues") is not None:
        if block.lang not in RUN_PYTHON:
            return "'continues' is for python blocks (bash blocks share the page's /tmp/ instead)"
        try:
            continued(block, page)
        except ValueError as exc:
            return str(exc)
    file = block.marker("file")
    if file is not None and not re.fullmatch(r"/tmp/[\w.-]+", file):
        return f"'file: {file}': a file block is saved as /tmp/NAME (the page's temp dir)"
    if block.marker("vllm-venv") is not None and block.lang not in RUN_BASH:
        return "'vllm-venv' is for bash blocks: they say how the engine venv's python runs a script"
    return None
