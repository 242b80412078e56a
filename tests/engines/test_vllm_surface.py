"""lorasync's vLLM import surface (lorasync/engines/vllm/_surface.py) against vLLM main's source,
against the 0.33.0 and 0.34.0 releases, and against the installed vLLM.

vLLM main was read at the commit recorded in tests/engines/data/vllm_main_surface.json (its
modules, alias shims and the attributes lorasync takes), the releases from their wheels
(tests/engines/data/vllm_release_surfaces.json: neither has the moved layout); CI can read
neither, so the records are the test data and the installed vLLM (0.32, the CPU venv) is checked
live.
"""

from __future__ import annotations

import ast
import importlib.machinery
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

import lorasync
from lorasync.engines.vllm._surface import MOVED_PACKAGE, SURFACE, moved_layout, order, resolve
from lorasync.errors import CapabilityError

ROOT = Path(lorasync.__file__).resolve().parent
MAIN = json.loads((Path(__file__).with_name("data") / "vllm_main_surface.json").read_text())
RELEASES = json.loads((Path(__file__).with_name("data") / "vllm_release_surfaces.json").read_text())["releases"]


def _lookup(modules: dict[str, dict], module: str) -> set[str] | None:
    """The attributes ``module`` offers in a recorded surface (None: no such module)."""
    seen = set()
    while module in modules and "alias_of" in modules[module] and module not in seen:
        seen.add(module)
        module = modules[module]["alias_of"]
    entry = modules.get(module)
    return None if entry is None else set(entry.get("attrs", []))


def _moved(modules: dict[str, dict]) -> bool:
    """What :func:`moved_layout` says of a recorded surface: some module of the moved package exists."""
    return any(m == MOVED_PACKAGE or m.startswith(MOVED_PACKAGE + ".") for m in modules)


def _resolves(modules: dict[str, dict], key: str) -> str | None:
    """Where :func:`resolve` would find ``key`` in ``modules`` (the first home it tries that has it)."""
    name = SURFACE[key]
    for module in order(name, _moved(modules)):
        attrs = _lookup(modules, module)
        if attrs is not None and name.attr in attrs:
            return module
    return None


def test_lorasync_imports_vllm_only_through_the_surface() -> None:
    """No module but _surface.py imports vLLM, so SURFACE is every vLLM name lorasync uses."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.name == "_surface.py" and path.parent.name == "vllm":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
                names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n == "vllm" or n.startswith("vllm.")]
    assert not offenders, offenders


@pytest.mark.parametrize("key", sorted(SURFACE))
def test_every_name_resolves_in_vllm_main(key: str) -> None:
    assert _moved(MAIN["modules"])  # main has the moved layout
    found = _resolves(MAIN["modules"], key)
    assert found is not None, f"{key}: none of {order(SURFACE[key], True)} has it at vllm {MAIN['commit'][:12]}"
    if SURFACE[key].public:
        assert found == SURFACE[key].homes[0][0]  # the documented home, even where it is now a shim
    else:
        assert found.startswith(MOVED_PACKAGE + "."), found  # the canonical module, not the shim


@pytest.mark.parametrize("key", sorted(SURFACE))
def test_the_fallback_covers_the_shims_going_away(key: str) -> None:
    """Every name main serves through an alias shim has the shim's target among its homes, so a
    release that drops the shims still resolves."""
    without_shims = {m: e for m, e in MAIN["modules"].items() if "alias_of" not in e}
    assert _resolves(without_shims, key) is not None, f"{key} would vanish with vLLM's compat shims"


@pytest.mark.parametrize("release", sorted(RELEASES))
@pytest.mark.parametrize("key", sorted(SURFACE))
def test_every_name_resolves_from_the_old_path_in_the_releases(release: str, key: str) -> None:
    """vLLM 0.33.0 and 0.34.0 have no moved layout: every name comes from the old path, the first
    home tried (no fallback, no failed import first)."""
    recorded = RELEASES[release]
    assert recorded["no_runtime_package"] and recorded["no_foundation_package"]
    assert not _moved(recorded["modules"])
    first = order(SURFACE[key], False)[0]
    assert first.startswith(("vllm.lora.", "vllm.exceptions")) or first == "vllm", first
    assert _resolves(recorded["modules"], key) == first


def test_the_layout_not_the_version_picks_the_home() -> None:
    name = SURFACE["parse_fine_tuned_lora_name"]
    assert order(name, False)[0] == "vllm.lora.utils"  # every release through 0.34
    assert order(name, True)[0] == f"{MOVED_PACKAGE}.utils"  # main's moved layout
    assert set(order(name, False)) == set(order(name, True))  # the other home stays the fallback
    assert order(SURFACE["LoRARequest"], True)[0] == "vllm.lora.request"  # public: its documented home


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, version: str, present: tuple[str, ...], gone: tuple[str, ...]) -> dict[str, types.ModuleType]:
    """A fake ``vllm`` of ``version`` whose ``present`` modules exist (a parse_fine_tuned_lora_name
    in each ``*utils``) and whose ``gone`` modules raise ImportError."""
    resolve.cache_clear()
    mods: dict[str, types.ModuleType] = {}
    for name in ("vllm", *present):
        mods[name] = types.ModuleType(name)
        mods[name].__path__ = []  # type: ignore[attr-defined]  # a package: find_spec looks inside
        mods[name].__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, name, mods[name])
        if name.endswith(".utils"):
            mods[name].parse_fine_tuned_lora_name = lambda n, mapper=None: (n, True)  # type: ignore[attr-defined]
    mods["vllm"].__version__ = version  # type: ignore[attr-defined]
    for name in gone:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    return mods


_MOVED = ("vllm.runtime", "vllm.runtime.modeling", MOVED_PACKAGE, f"{MOVED_PACKAGE}.utils")


@pytest.fixture
def shimless_vllm(monkeypatch: pytest.MonkeyPatch) -> dict[str, types.ModuleType]:
    """A vLLM after main's shims are gone: only the canonical LoRA utils module exists."""
    yield _fake_vllm(monkeypatch, "0.35.0.dev1+g055e47c2", _MOVED, ("vllm.lora", "vllm.lora.utils", "vllm.lora.peft_helper", f"{MOVED_PACKAGE}.peft_helper"))
    resolve.cache_clear()


def test_resolve_finds_a_moved_name_and_refuses_a_missing_one(shimless_vllm: dict[str, types.ModuleType]) -> None:
    assert moved_layout()
    assert resolve("parse_fine_tuned_lora_name") is shimless_vllm[f"{MOVED_PACKAGE}.utils"].parse_fine_tuned_lora_name
    with pytest.raises(CapabilityError, match=rf"vLLM 0\.35\.0 has no PEFTHelper.*{MOVED_PACKAGE}\.peft_helper.*vllm\.lora\.peft_helper"):
        resolve("PEFTHelper")


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0", "0.34.1", "0.40.0"])
def test_a_release_with_the_old_layout_resolves_the_old_path_whatever_its_version(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """What 0.33.0 and 0.34.0 are (the old layout): the name comes from vllm.lora.utils, and the
    moved package is never imported; a later release number alone changes nothing."""
    mods = _fake_vllm(monkeypatch, version, ("vllm.lora", "vllm.lora.utils"), ())
    try:
        assert not moved_layout()
        assert resolve("parse_fine_tuned_lora_name") is mods["vllm.lora.utils"].parse_fine_tuned_lora_name
        assert "vllm.runtime" not in sys.modules
    finally:
        resolve.cache_clear()


def test_installed_vllm_resolves_every_name(vllm_python: Path) -> None:
    """The installed vLLM (0.32 CPU) has every name, from the home the gate names first."""
    script = (
        "import importlib, json\n"
        "from lorasync.engines.vllm._surface import SURFACE, resolve, order, vllm_version, moved_layout\n"
        "out = {}\n"
        "for key, name in SURFACE.items():\n"
        "    obj = resolve(key)\n"
        "    first = importlib.import_module(order(name, moved_layout())[0])\n"
        "    out[key] = [getattr(obj, '__module__', None), getattr(first, name.attr, None) is obj]\n"
        "print(json.dumps({'version': list(vllm_version()), 'moved': moved_layout(), 'names': out}))\n"
    )
    env = {"PYTHONPATH": str(ROOT.parent), "PATH": "/usr/bin:/bin", "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run([str(vllm_python), "-c", script], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(report["names"]) == set(SURFACE)
    version = tuple(report["version"])
    assert version[:2] == (0, 32) and report["moved"] is False  # the CPU build lorasync runs: the old layout, no shims
    for key, (defined_in, from_first_home) in report["names"].items():
        # Every object really is vLLM's, and came from the first home the gate names (no fallback).
        assert defined_in and defined_in.startswith("vllm"), (key, defined_in)
        assert from_first_home, key
