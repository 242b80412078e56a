"""lorasync's vLLM import surface (lorasync/engines/vllm/_surface.py) against vLLM main's source
and against the installed vLLM.

vLLM main was read at the commit recorded in tests/engines/data/vllm_main_surface.json (its
modules, alias shims and the attributes lorasync takes); CI cannot read the source itself, so
the record is the test data and the installed vLLM (0.32, the CPU venv) is checked live.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

import lorasync
from lorasync.engines.vllm._surface import MOVED_IN, SURFACE, order, resolve
from lorasync.errors import CapabilityError

ROOT = Path(lorasync.__file__).resolve().parent
MAIN = json.loads((Path(__file__).with_name("data") / "vllm_main_surface.json").read_text())


def _lookup(modules: dict[str, dict], module: str) -> set[str] | None:
    """The attributes ``module`` offers in a recorded surface (None: no such module)."""
    seen = set()
    while module in modules and "alias_of" in modules[module] and module not in seen:
        seen.add(module)
        module = modules[module]["alias_of"]
    entry = modules.get(module)
    return None if entry is None else set(entry.get("attrs", []))


def _resolves(modules: dict[str, dict], key: str, version: tuple[int, ...]) -> str | None:
    """Where :func:`resolve` would find ``key`` in ``modules`` (the first home it tries that has it)."""
    name = SURFACE[key]
    for module in order(name, version):
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
    found = _resolves(MAIN["modules"], key, MOVED_IN)
    assert found is not None, f"{key}: none of {order(SURFACE[key], MOVED_IN)} has it at vllm {MAIN['commit'][:12]}"
    if SURFACE[key].public:
        assert found == SURFACE[key].homes[0][0]  # the documented home, even where it is now a shim


@pytest.mark.parametrize("key", sorted(SURFACE))
def test_the_gate_covers_the_shims_going_away(key: str) -> None:
    """Every name main serves through an alias shim has the shim's target among its homes, so a
    release that drops the shims still resolves."""
    without_shims = {m: e for m, e in MAIN["modules"].items() if "alias_of" not in e}
    assert _resolves(without_shims, key, MOVED_IN) is not None, f"{key} would vanish with vLLM's compat shims"


def test_private_names_prefer_the_canonical_module_from_0_33() -> None:
    name = SURFACE["parse_fine_tuned_lora_name"]
    assert order(name, (0, 32, 0))[0] == "vllm.lora.utils"
    assert order(name, (0, 33, 0))[0] == "vllm.runtime.modeling.lora.utils"
    assert order(SURFACE["LoRARequest"], (0, 34, 0))[0] == "vllm.lora.request"  # public: its documented home


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> dict[str, types.ModuleType]:
    """A vLLM 0.34 whose shims are gone: only the canonical LoRA utils module exists."""
    resolve.cache_clear()
    mods: dict[str, types.ModuleType] = {}
    for name in ("vllm", "vllm.runtime", "vllm.runtime.modeling", "vllm.runtime.modeling.lora", "vllm.runtime.modeling.lora.utils"):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
    mods["vllm"].__version__ = "0.34.0"  # type: ignore[attr-defined]
    mods["vllm.runtime.modeling.lora.utils"].parse_fine_tuned_lora_name = lambda name, mapper=None: (name, True)  # type: ignore[attr-defined]
    for gone in ("vllm.lora", "vllm.lora.utils", "vllm.lora.peft_helper", "vllm.runtime.modeling.lora.peft_helper"):
        monkeypatch.setitem(sys.modules, gone, None)  # import raises ImportError
    yield mods
    resolve.cache_clear()


def test_resolve_finds_a_moved_name_and_refuses_a_missing_one(fake_vllm: dict[str, types.ModuleType]) -> None:
    assert resolve("parse_fine_tuned_lora_name") is fake_vllm["vllm.runtime.modeling.lora.utils"].parse_fine_tuned_lora_name
    with pytest.raises(CapabilityError, match=r"vLLM 0\.34\.0 has no PEFTHelper.*vllm\.runtime\.modeling\.lora\.peft_helper.*vllm\.lora\.peft_helper"):
        resolve("PEFTHelper")


def test_installed_vllm_resolves_every_name(vllm_python: Path) -> None:
    """The installed vLLM (0.32 CPU) has every name, from the home the gate names first."""
    script = (
        "import importlib, json\n"
        "from lorasync.engines.vllm._surface import SURFACE, resolve, order, vllm_version\n"
        "out = {}\n"
        "for key, name in SURFACE.items():\n"
        "    obj = resolve(key)\n"
        "    first = importlib.import_module(order(name, vllm_version())[0])\n"
        "    out[key] = [getattr(obj, '__module__', None), getattr(first, name.attr, None) is obj]\n"
        "print(json.dumps({'version': list(vllm_version()), 'names': out}))\n"
    )
    env = {"PYTHONPATH": str(ROOT.parent), "PATH": "/usr/bin:/bin", "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run([str(vllm_python), "-c", script], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(report["names"]) == set(SURFACE)
    version = tuple(report["version"])
    assert version < MOVED_IN  # the CPU build lorasync runs is 0.32: the old layout, no shims
    for key, (defined_in, from_first_home) in report["names"].items():
        # Every object really is vLLM's, and came from the first home the gate names (no fallback).
        assert defined_in and defined_in.startswith("vllm"), (key, defined_in)
        assert from_first_home, key
