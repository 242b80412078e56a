"""The ``lorasync`` command line as a user runs it: fast --help/--version, exit codes that tell
bad input (2), engine failure (3) and a partial publish (4) apart, --json everywhere (errors
included), and a demo that is typed about bad input, trains (loss goes down), cleans up after
itself, leaves an adapter ``inspect`` accepts, and can be re-run against the same engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from lorasync.cli import main

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "httpx", "rich", "transformers", "peft", "tenacity")


def _fresh_python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True).stdout


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["demo", "--help"], ["inspect", "--help"]])
def test_help_and_version_import_no_heavy_module(argv: list[str]) -> None:
    out = _fresh_python(
        "import sys\nfrom lorasync.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        f"print('LOADED', sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    assert "lorasync" in out
    assert out.strip().endswith("LOADED []")


def test_import_lorasync_is_lazy_and_names_still_resolve() -> None:
    out = _fresh_python(f"import sys, lorasync\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))\nprint(lorasync.Publisher.__module__)")
    assert out.split("\n")[:2] == ["[]", "lorasync.publisher._publisher"]


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, Any]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code)
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "argv, error",
    [
        (["inspect", "/nonexistent/adapter", "--json"], "ConfigError"),
        (["--json", "publish", "/nonexistent", "--engine", "vllm:http://127.0.0.1:1", "--name", "p", "--version", "1"], "ConfigError"),
        (["publish", "/tmp", "--engine", "http://127.0.0.1:8000", "--name", "p", "--version", "1", "--json"], "ConfigError"),
        (["demo", "--engine", "vllm://127.0.0.1:8000", "--json"], "ConfigError"),
        (["demo", "--base", "/nonexistent/base", "--json"], "ConfigError"),
        (["demo", "--steps", "x", "--json"], "UsageError"),
        (["inspect", "--json"], "UsageError"),
    ],
)
def test_bad_input_exits_2_with_a_json_error(capsys: pytest.CaptureFixture[str], argv: list[str], error: str) -> None:
    code, doc = _json(capsys, argv)
    assert code == 2
    assert doc["ok"] is False and doc["exit_code"] == 2 and doc["error"]["type"] == error
    assert doc["error"]["message"]


def test_bad_input_messages_say_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--engine", "vllm://127.0.0.1:8000"]) == 2
    assert "vllm:http://127.0.0.1:8000" in capsys.readouterr().err
    assert main(["demo", "--base", "/nonexistent/base"]) == 2
    err = capsys.readouterr().err
    assert "/nonexistent/base does not exist" in err and "--make-base" in err and "Repo id" not in err
    assert main(["inspect", "/nonexistent/adapter"]) == 2
    assert "/nonexistent/adapter does not exist" in capsys.readouterr().err


@pytest.fixture(scope="module")
def saved_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lorasync.testing import make_peft_model, make_tiny_model

    from lorasync.exporters.fsdp import export

    base = tmp_path_factory.mktemp("base")
    model = make_tiny_model(base)
    out = tmp_path_factory.mktemp("adapter") / "a"
    export(make_peft_model(model, seed=3), base_model_name_or_path=str(base)).save(out)
    return out


def test_engine_failure_exits_3_and_partial_publish_exits_4(capsys: pytest.CaptureFixture[str], saved_adapter: Path, tmp_path: Path, dead_url: str) -> None:
    dead = f"vllm:{dead_url}"
    base = json.loads((saved_adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    common = ["--name", "cli", "--version", "1", "--root", str(tmp_path), "--json"]
    code, doc = _json(capsys, ["publish", str(saved_adapter), "--engine", dead, *common])
    assert code == 3 and doc["exit_code"] == 3 and doc["ok"] is False
    assert doc["results"][0]["error"]["type"] == "EngineUnavailableError"
    code, doc = _json(capsys, ["publish", str(saved_adapter), "--engine", f"peft:{base}", "--engine", dead, *common])
    assert code == 4 and doc["exit_code"] == 4
    assert sorted(r["status"] for r in doc["results"]) == ["failed", "loaded"]
    code, doc = _json(capsys, ["publish", str(saved_adapter), "--engine", f"peft:{base}", *common])
    assert code == 0 and doc["ok"] is True and doc["served_name"] == "cli@v1"


def test_inspect_json(capsys: pytest.CaptureFixture[str], saved_adapter: Path) -> None:
    code, doc = _json(capsys, ["inspect", str(saved_adapter), "--json"])
    assert code == 0 and doc["verdicts"] == {"peft": "loads", "vllm": "loads", "sglang": "loads"}
    assert doc["rank"] == 8 and len(doc["modules"]) == 14


def test_verbose_logs_each_publish(caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str], saved_adapter: Path, tmp_path: Path) -> None:
    base = json.loads((saved_adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    with caplog.at_level("INFO", logger="lorasync"):
        assert main(["-v", "publish", str(saved_adapter), "--engine", f"peft:{base}", "--name", "logged", "--version", "3", "--root", str(tmp_path)]) == 0
    assert any("publishing" in r.getMessage() and "logged v3" in r.getMessage() for r in caplog.records)
    assert "logged@v3" in capsys.readouterr().out
    assert main(["-q", "publish", str(saved_adapter), "--engine", f"peft:{base}", "--name", "quiet", "--version", "1", "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out == ""


def test_demo_trains_publishes_cleans_up_and_saves(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The demo's temp folder goes to a folder of this test's own: the shared /tmp may hold another
    # process's demo folder that comes or goes meanwhile (the suite runs on two workers).
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    save = tmp_path / "last"
    code, doc = _json(capsys, ["demo", "--steps", "4", "--save", str(save), "--json"])
    assert code == 0 and doc["ok"] is True
    losses = [s["loss"] for s in doc["steps"]]
    assert len(losses) == 4 and all(b < a for a, b in zip(losses, losses[1:])), losses
    assert [s["served_name"] for s in doc["steps"]] == [f"demo-policy@v{i}" for i in range(1, 5)]
    assert all(s["results"][0]["timings"].get("verify") is not None for s in doc["steps"])
    # its temp folder removed, nothing left there but torch's compile cache (torchinductor_<user>,
    # made in the temp folder by the first import of peft in a process)
    assert [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")] == []
    assert doc["saved"] == str(save)
    assert main(["inspect", str(save)]) == 0
    assert "vllm    loads" in capsys.readouterr().out


@pytest.mark.vllm
def test_demo_reruns_against_the_same_vllm(capsys: pytest.CaptureFixture[str], vllm_server: Any, tiny_model_dir: Path) -> None:
    from lorasync.engines import connect

    argv = ["demo", "--base", str(tiny_model_dir), "--engine", f"vllm:{vllm_server.url}", "--steps", "2", "--name", "demo-rerun", "--json"]
    engine = connect("vllm", vllm_server.url)
    try:
        first = _json(capsys, argv)
        second = _json(capsys, argv)
        assert first[0] == 0 and second[0] == 0, (first, second)
        assert [s["served_name"] for s in first[1]["steps"]] == ["demo-rerun@v1", "demo-rerun@v2"]
        assert [s["served_name"] for s in second[1]["steps"]] == ["demo-rerun@v3", "demo-rerun@v4"]
    finally:
        for served in engine.list_adapters():
            if served.startswith("demo-rerun"):
                engine.unload_adapter(served)
        engine.close()


def test_retries_are_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    import httpx

    from lorasync import RetryPolicy

    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise httpx.ConnectError("engine restarting")
        return "ok"

    with caplog.at_level("INFO", logger="lorasync"):
        assert RetryPolicy(attempts=3, backoff=0.001, backoff_max=0.001, jitter=0.0).retrying()(flaky) == "ok"
    lines = [r.getMessage() for r in caplog.records if r.name == "lorasync.runtime._retry"]
    assert len(lines) == 2 and "ConnectError: engine restarting" in lines[0] and "retrying in" in lines[0]


def test_vllm_worker_extension_imports_without_peft_or_transformers() -> None:
    # The engine's own venv need not have them: block both and import the extension.
    out = _fresh_python(
        "import builtins, sys\nreal = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name.split('.')[0] in ('peft', 'transformers'):\n        raise ImportError('blocked ' + name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\nimport lorasync.engines.vllm_worker\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('peft', 'transformers')))"
    )
    assert out.strip() == "[]"


def test_bench_without_matplotlib_writes_json_and_markdown(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import builtins
    import importlib.util

    real_find, real_import = importlib.util.find_spec, builtins.__import__

    def no_mpl_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".")[0] == "matplotlib":
            raise ImportError("matplotlib is not installed")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.split(".")[0] == "matplotlib" else real_find(name, *a))
    monkeypatch.setattr(builtins, "__import__", no_mpl_import)
    out = tmp_path / "bench"
    assert main(["bench", "bytes", "--quick", "--shape", "tiny", "--rank", "2", "--out", str(out), "--no-progress", "--root", str(tmp_path / "shm")]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["bytes.json", "bytes.md"]
    assert "pip install 'lorasync[bench]'" in capsys.readouterr().err


def test_export_megatron_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, doc = _json(capsys, ["export", "megatron", "--shards", str(tmp_path / "none_{tp}.safetensors"), "--base-config", str(tmp_path), "--alpha", "16", "--out", str(tmp_path / "o"), "--json"])
    assert code == 2 and doc["error"]["type"] == "MissingShardError"


def test_demo_against_an_unreachable_engine_fails_before_training(capsys: pytest.CaptureFixture[str], dead_url: str) -> None:
    code, doc = _json(capsys, ["demo", "--engine", f"vllm:{dead_url}", "--json"])
    assert code == 3 and doc["error"]["type"] == "EngineUnavailableError"
    assert "steps" not in doc  # no step ran
