"""The engine registry: duplicate rule, lazy imports, entry-point discovery (broken plugins are
skipped, built-ins come from lorasync's own entry points) and a real installed plugin package.

Every test uses a private ``Registry``; the global one is only read."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from lorasync.engines._registry import Registry
from lorasync.engines import ENGINE_GROUP, Engine, available_engines, connect
from lorasync.engines.peft import PeftEngine
from lorasync.errors import ConfigError, DuplicateRegistrationError, RegistryError, UnknownEngineError
from lorasync.testing import EngineConformance, MemoryEngine

REPO = Path(__file__).resolve().parents[2]
DUMMY_PLUGIN = REPO / "tests" / "plugins" / "lorasync_dummy_engine"


class EngineA(Engine):
    kind = "a"


class EngineB(Engine):
    kind = "b"


# -- duplicate rule -------------------------------------------------------------------------


def test_registering_the_same_target_again_is_a_no_op() -> None:
    reg = Registry()
    reg.register("a", EngineA)
    reg.register("a", EngineA)
    reg.register("a", f"{__name__}:EngineA")  # the same class, spelled lazily
    assert reg.get("a") is EngineA
    assert list(reg.available()) == ["a"]


def test_a_different_target_raises_and_keeps_the_first() -> None:
    reg = Registry()
    reg.register("a", EngineA)
    with pytest.raises(DuplicateRegistrationError, match="clobber=True") as info:
        reg.register("a", EngineB)
    assert info.value.name == "a"  # type: ignore[attr-defined]
    assert reg.get("a") is EngineA


def test_clobber_replaces_even_an_already_imported_target() -> None:
    reg = Registry()
    reg.register("a", EngineA)
    assert reg.get("a") is EngineA
    reg.register("a", EngineB, clobber=True)
    assert reg.get("a") is EngineB


@pytest.mark.parametrize(("name", "target"), [("", EngineA), ("a", "no_colon_here")])
def test_malformed_registrations_are_refused(name: str, target: Any) -> None:
    with pytest.raises(RegistryError):
        Registry().register(name, target)


# -- lazy imports ---------------------------------------------------------------------------


def test_lazy_targets_are_imported_on_first_get_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = f"lorasync_lazy_probe_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        "from lorasync.engines import Engine\n\nclass ProbeEngine(Engine):\n    kind = 'probe'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry()
    try:
        reg.register("probe", f"{module}:ProbeEngine")
        assert "probe" in reg.available()
        assert module not in sys.modules
        cls = reg.get("probe")
        assert module in sys.modules
        assert cls.__name__ == "ProbeEngine" and issubclass(cls, Engine)
        assert reg.get("probe") is cls
    finally:
        sys.modules.pop(module, None)


def test_an_unimportable_target_fails_on_get_with_an_install_hint() -> None:
    reg = Registry()
    reg.register("ghost", "lorasync_no_such_package.engine:GhostEngine")  # registering is fine
    with pytest.raises(RegistryError, match="lorasync_no_such_package.*Install") as info:
        reg.get("ghost")
    assert info.value.target == "lorasync_no_such_package.engine:GhostEngine"  # type: ignore[attr-defined]


def test_an_unknown_name_lists_what_is_available() -> None:
    reg = Registry()
    reg.register("alpha", EngineA)
    reg.register("beta", EngineB)
    with pytest.raises(UnknownEngineError, match=r"'gamma'.*\['alpha', 'beta'\]") as info:
        reg.get("gamma")
    assert isinstance(info.value, KeyError)


def test_connect_uses_a_private_registry_and_checks_the_class() -> None:
    reg = Registry()
    reg.register("memory", MemoryEngine)
    reg.register("not-an-engine", "collections:OrderedDict")
    engine = connect("memory", "memory://private", registry=reg, max_loras=2)
    assert isinstance(engine, MemoryEngine)
    assert engine.capabilities().max_loras == 2 and engine.url == "memory://private"
    with pytest.raises(ConfigError, match="not a lorasync Engine"):
        connect("not-an-engine", registry=reg)
    with pytest.raises(UnknownEngineError):
        connect("memory")  # not in the global registry


# -- entry points -----------------------------------------------------------------------------


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, entries: list[tuple[str, str]]) -> list[str]:
    """Make importlib.metadata report ``entries`` for any group; returns the groups queried."""
    queried: list[str] = []

    def entry_points(*, group: str) -> list[metadata.EntryPoint]:
        queried.append(group)
        return [metadata.EntryPoint(name, value, group) for name, value in entries]

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    return queried


def test_entry_points_are_discovered_once_and_broken_ones_skipped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    queried = _fake_entry_points(
        monkeypatch,
        [
            ("good", f"{__name__}:EngineA"),
            ("broken", "this is not a target"),
            ("missing", "lorasync_no_such_plugin:Engine"),  # listed; fails only when asked for
            # a plugin claiming a built-in's name, listed first: the built-in still wins
            ("peft", "some_plugin:NotPeft"),
            ("peft", "lorasync.engines.peft:PeftEngine"),
        ],
    )
    reg = Registry("lorasync.test_engines")

    with caplog.at_level(logging.ERROR, logger="lorasync"):
        names = reg.available()
        reg.get("good")
        reg.available()

    assert queried == ["lorasync.test_engines"]  # discovered once
    assert set(names) == {"good", "missing", "peft"}
    skipped = {record.args[1] for record in caplog.records if record.name == "lorasync"}  # type: ignore[index]
    assert skipped == {"broken", "peft"}
    assert reg.get("peft") is PeftEngine
    with pytest.raises(RegistryError, match="lorasync_no_such_plugin"):
        reg.get("missing")
    assert reg.get("good") is EngineA  # a broken plugin never breaks the others


def test_builtins_come_from_lorasyncs_own_entry_points() -> None:
    private = Registry(ENGINE_GROUP)
    targets = private.available()
    assert targets["vllm"] == "lorasync.engines.vllm:VLLMEngine"
    assert targets["sglang"] == "lorasync.engines.sglang:SGLangEngine"
    assert targets["peft"] == "lorasync.engines.peft:PeftEngine"
    assert private.get("peft") is PeftEngine
    assert {"vllm", "sglang", "peft"} <= set(available_engines())


def test_importing_lorasync_imports_no_engine_implementation() -> None:
    code = (
        "import sys, lorasync, lorasync.engines\n"
        "print(sorted(m for m in sys.modules if m.startswith(('lorasync.engines.', 'transformers'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120, check=True
    )
    loaded = out.stdout.strip()
    assert "lorasync.engines.peft" not in loaded and "vllm" not in loaded and "transformers" not in loaded, loaded


def test_a_moved_builtin_target_counts_as_its_new_one() -> None:
    """``lorasync.engines.peft_local`` (the PEFT engine's old module) still names the built-in:
    metadata written before the move and plugins that register the old target do not clash."""
    reg = Registry()
    reg.register("peft", "lorasync.engines.peft:PeftEngine")
    reg.register("peft", "lorasync.engines.peft_local:PeftEngine")  # the same class: no DuplicateRegistrationError
    assert reg.available()["peft"] == "lorasync.engines.peft:PeftEngine"
    assert reg.get("peft") is PeftEngine
    with pytest.raises(DuplicateRegistrationError):
        reg.register("peft", f"{__name__}:EngineA")


def test_a_class_and_the_lazy_target_that_re_exports_it_are_the_same() -> None:
    reg = Registry()
    reg.register("peft", "lorasync.engines.peft:PeftEngine")
    reg.register("peft", PeftEngine)  # defined in lorasync.engines.peft.engine: no DuplicateRegistrationError
    assert reg.get("peft") is PeftEngine
    with pytest.raises(DuplicateRegistrationError):
        reg.register("peft", EngineA)


def test_the_old_peft_module_is_a_deprecated_alias() -> None:
    sys.modules.pop("lorasync.engines.peft_local", None)
    with pytest.warns(DeprecationWarning, match="lorasync.engines.peft"):
        from lorasync.engines.peft_local import PeftEngine as Old
    assert Old is PeftEngine


# -- an installed third-party plugin ------------------------------------------------------------


def _env(*paths: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(REPO)])
    return env


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dummy plugin pip-installed into a private target directory (built from a copy, so
    the source tree stays clean)."""
    root = tmp_path_factory.mktemp("dummy-plugin")
    source = shutil.copytree(DUMMY_PLUGIN, root / "src")
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--target", str(target), str(source)],
        check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return target


def test_an_installed_plugin_is_found_by_connect(installed_plugin: Path) -> None:
    code = textwrap.dedent(
        """
        import json
        from lorasync.engines import available_engines, connect
        engine = connect("dummy", "dummy://probe", max_loras=1)
        print(json.dumps({
            "available": available_engines(),
            "class": f"{type(engine).__module__}:{type(engine).__name__}",
            "caps": [engine.capabilities().engine, engine.capabilities().max_loras, engine.url],
        }))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_env(installed_plugin), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"dummy", "vllm", "sglang", "peft"} <= set(report["available"])
    assert report["class"] == "lorasync_dummy_engine:DummyEngine"
    assert report["caps"] == ["dummy", 1, "dummy://probe"]


def test_an_installed_plugin_passes_the_conformance_suite(installed_plugin: Path, tmp_path: Path) -> None:
    check = shutil.copy(DUMMY_PLUGIN / "check_conformance.py", tmp_path / "check_conformance.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # keep lorasync's own test config out
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(tmp_path / "pytest.ini"),
         "--rootdir", str(tmp_path), check],
        env=_env(installed_plugin), cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    suite = [name for name in dir(EngineConformance) if name.startswith("test_")]
    assert f"{len(suite)} passed" in out.stdout, out.stdout
