"""lorasync.wire is the ground floor: it imports nothing of lorasync but itself and the errors,
and the Adapter reaches the byte formats without going through transports (no import loop)."""

from __future__ import annotations

import ast
from pathlib import Path

import lorasync

PACKAGE = Path(lorasync.__file__).parent


def _lorasync_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lorasync"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lorasync"))
    return found


def test_wire_imports_only_itself_and_the_errors() -> None:
    files = sorted((PACKAGE / "wire").glob("*.py"))
    assert files
    for path in files:
        above = {m for m in _lorasync_imports(path) if m != "lorasync.errors" and not m.startswith("lorasync.wire")}
        assert not above, f"{path.name} imports {sorted(above)}"


def test_adapter_does_not_import_transports() -> None:
    assert not {m for m in _lorasync_imports(PACKAGE / "adapter" / "_adapter.py") if m.startswith("lorasync.transports")}
