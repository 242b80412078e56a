"""Issue 28's findings index (``_findings.py``) stays true: every finding has a regression test,
and every test it names exists (a renamed or deleted test would silently drop out of the
reliability table's rows)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ._findings import CLASSES, FINDINGS

ROOT = Path(__file__).resolve().parents[2]


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))} | {
        node.targets[0].id for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }


def test_every_numbered_finding_of_issue_28_is_indexed_once() -> None:
    numbers = [f.number for f in FINDINGS if f.number.isdigit()]
    assert sorted(numbers, key=int) == [str(n) for n in range(1, 42)]
    assert all(f.klass in CLASSES for f in FINDINGS)


@pytest.mark.parametrize("finding", FINDINGS, ids=lambda f: f.number)
def test_every_indexed_test_exists(finding) -> None:
    assert finding.tests, f"finding {finding.number} has no regression test"
    for test in finding.tests:
        path, _, function = test.partition("::")
        file = ROOT / path
        assert file.is_file(), f"finding {finding.number}: no file {path}"
        if function:
            assert function in _functions(file), f"finding {finding.number}: {path} has no {function}"


def test_the_table_has_a_row_per_class_that_ran() -> None:
    from ._figures import table

    runs = {CLASSES[0]: {"passed": 3, "failed": 1, "skipped": 0}}
    text = table({}, runs)
    assert f"issue 28: {CLASSES[0]}" in text and "tests 3 ok, 1 failed, 0 skipped" in text
    assert CLASSES[1] not in text
