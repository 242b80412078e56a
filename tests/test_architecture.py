"""The package's floors, checked from its source with ``ast`` (nothing is imported).

Floors, lowest first (docs/architecture.md draws them): a module may import its own floor and
the floors below it, never one above, and no two modules may import each other, directly or
round a loop. Imports inside functions (lazy imports) count like any other: a lazy import hides a
loop, it does not remove it. ``if TYPE_CHECKING:`` imports do not count (they never run).

An exception needs an entry in ``ALLOWED`` saying why; an entry that no longer matches anything
fails too, so the list only shrinks. Modules over 400 lines fail unless their docstring says why
they are long (a sentence with "lines" and "because"), or ``LONG_PENDING`` names the work that is
splitting them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import lorasync

PACKAGE = Path(lorasync.__file__).resolve().parent

FLOORS: list[tuple[str, ...]] = [
    ("errors",),
    ("wire",),  # the byte formats
    ("runtime",),  # the loop, lifecycles, retry, collectives: no adapter knowledge
    ("adapter", "transforms"),  # the canonical adapter and what describes it
    ("exporters", "transports", "engines"),
    ("publisher", "inspection"),  # one adapter's publish to its engines
    ("fleet",),  # many tenants on shared engines, through the publisher's parts
    ("distributed",),
    ("cli", "integrations", "testing", "__main__", "__init__"),
]

# The package root holds only the public modules; every other room lives in the package of its
# floor (docs/architecture.md), so the tree shows whose room is whose.
ROOT_MODULES = {"__init__", "__main__", "errors", "transforms", "inspection"}

# (importer, imported) -> why it may break the rules for now.
ALLOWED: dict[tuple[str, str], str] = {
}

# Modules over 400 lines that another part of issue 13 is splitting right now.
LONG_PENDING: dict[str, str] = {
}

MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _floor(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for level, names in enumerate(FLOORS):
        if top in names:
            return level
    raise AssertionError(f"{module} is on no floor: add lorasync.{top} to FLOORS in tests/test_architecture.py")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path, known: set[str], *, typing: bool = False) -> set[str]:
    """The lorasync modules ``module`` imports at run time (module level or inside functions);
    with ``typing``, also those it imports for type checking only."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not typing:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # ``from lorasync import errors`` imports a module, not the package
                submodule = f"{target}.{alias.name}"
                found.add(submodule if submodule in known else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    edges = set()
    for target in found:
        if target != "lorasync" and not target.startswith("lorasync."):
            continue
        if target in known:
            edges.add(target)
            continue
        # ``from lorasync.x import name`` where lorasync.x is a package: its __init__.
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target:
            edges.add(target)
    edges.discard(module)
    return edges


def _graph(*, typing: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known, typing=typing) for name, path in modules.items()}


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    loops.append(sorted(component))
    return loops


def _checked_graph(*, typing: bool = False) -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    """The import graph without the allowed edges, and which allowed edges were seen."""
    graph = _graph(typing=typing)
    used = set()
    for importer, targets in graph.items():
        for target in list(targets):
            if (importer, target) in ALLOWED:
                used.add((importer, target))
                targets.discard(target)
    return graph, used


def test_no_import_from_a_lower_floor_to_a_higher_one() -> None:
    graph, _ = _checked_graph()
    upward = [
        f"{importer} (floor {_floor(importer)}) imports {target} (floor {_floor(target)})"
        for importer, targets in sorted(graph.items())
        for target in sorted(targets)
        if _floor(target) > _floor(importer)
    ]
    assert upward == [], "imports that climb a floor (move the code down, or allow it in ALLOWED with why):\n" + "\n".join(upward)


def test_no_import_loops() -> None:
    """Type-only imports count here: a module that names another's class in its signatures is tied
    to it as much as one that calls it (a round's functions that took the whole Fleet were a
    circle with the Fleet that calls them)."""
    graph, _ = _checked_graph(typing=True)
    loops = _loops(graph)
    assert loops == [], f"import loops (lazy and type-only imports count): {loops}"


def test_the_package_root_holds_only_the_public_modules() -> None:
    found = {path.stem for path in PACKAGE.glob("*.py")}
    assert found == ROOT_MODULES, (
        f"modules at the package root besides the public ones: {sorted(found - ROOT_MODULES)} "
        "(put each in the package of its floor: runtime, adapter, publisher, fleet, ...)"
    )


def test_every_package_says_what_it_owns_and_what_it_may_import() -> None:
    missing = []
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if "May import" not in doc and "may import" not in doc:
            missing.append(init.parent.name)
    assert missing == [], f"packages whose docstring does not say which packages they may import: {missing}"


def test_every_allowed_exception_is_still_needed() -> None:
    _, used = _checked_graph()
    stale = sorted(set(ALLOWED) - used)
    assert stale == [], f"ALLOWED entries that match no import any more: delete them: {stale}"


def test_no_module_over_400_lines_unless_it_says_why() -> None:
    too_long, stale = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        source = path.read_text()
        lines = source.count("\n")
        if lines <= MAX_LINES:
            if rel in LONG_PENDING:
                stale.append(rel)
            continue
        doc = ast.get_docstring(ast.parse(source)) or ""
        if re.search(r"\blines\b", doc) and re.search(r"\bbecause\b", doc):
            continue
        if rel not in LONG_PENDING:
            too_long.append(f"{rel}: {lines} lines")
    assert too_long == [], "modules over 400 lines whose docstring does not say why they are long: " + ", ".join(too_long)
    assert stale == [], f"LONG_PENDING entries no longer over {MAX_LINES} lines: delete them: {stale}"


def test_the_checker_sees_what_it_looks_for(tmp_path: Path) -> None:
    """The walker finds lazy imports, relative imports and ``from pkg import module``, skips
    TYPE_CHECKING blocks, and the loop finder finds a loop."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from lorasync import errors\n"
        "from . import _keys\n"
        "if TYPE_CHECKING:\n    from lorasync.publisher._publisher import Publisher\n"
        "def f():\n    from lorasync.engines._engine import Engine\n"
    )
    path = PACKAGE / "adapter" / "_config.py"  # a real module's place, so relative imports resolve
    fake = tmp_path / "_config.py"
    fake.write_text(source)
    known = set(_modules())
    found = _imports("lorasync.adapter._config", fake, known)
    assert path.exists() and found == {"lorasync.errors", "lorasync.adapter._keys", "lorasync.engines._engine"}
    assert _imports("lorasync.adapter._config", fake, known, typing=True) == found | {"lorasync.publisher._publisher"}
    assert _loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _floor("lorasync.engines.sglang.rules") == 4 and _floor("lorasync") == len(FLOORS) - 1


def test_every_sync_face_is_its_async_twin_with_the_same_parameters() -> None:
    """Sync and async written once (lorasync.runtime._lifecycle.blocking): each public sync method
    of the publisher and the fleet runs its ``a``-twin; a parameter the face names and the twin
    does not take (or takes with another default) would fail only when called."""
    import inspect

    from lorasync import Fleet, Publisher

    faces = 0
    for cls in (Publisher, Fleet):
        for name, member in inspect.getmembers(cls, inspect.isfunction):
            twin = getattr(member, "__lorasync_twin__", None)
            if twin is None:
                continue
            faces += 1
            mine = inspect.signature(member).parameters
            theirs = inspect.signature(getattr(cls, twin)).parameters
            for param, spec in mine.items():
                assert param in theirs, f"{cls.__name__}.{name}() takes {param}, {twin}() does not"
                assert (spec.kind, spec.default) == (theirs[param].kind, theirs[param].default), f"{cls.__name__}.{name}({param}) differs from {twin}()"
    assert faces >= 9, faces
