"""``lorasync inspect`` on folders a hostile user builds (issue 28, items 21 and 27).

A folder inspect cannot read gives a typed lorasync error, exit code 2 (bad input), one strict
JSON document with ``--json`` and one ``error:`` line without it; nothing hangs (FIFOs, devices).
An adapter lorasync itself refuses (what ``Adapter.load``, and so ``publish``, raises) is refused
by every engine's verdict, with the same error, and its ``--json`` report is strict JSON.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lorasync import Adapter, AdapterConfig
from lorasync.cli import main

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
ATTN = "base_model.model.model.layers.0.self_attn"
ENGINES = ("peft", "vllm", "sglang")
BOUND_S = 60  # a FIFO or /dev/zero that blocked inspect would otherwise hang the suite


def _saved(root: Path, r: int = 8) -> Path:
    tensors = {}
    for leaf in ("q_proj", "k_proj", "v_proj"):
        tensors[f"{ATTN}.{leaf}.lora_A.weight"] = torch.zeros(r, 64)
        tensors[f"{ATTN}.{leaf}.lora_B.weight"] = torch.zeros(64, r)
    return Adapter(tensors, AdapterConfig(r=r, lora_alpha=16)).save(root / "adapter")


def _edit_config(path: Path, **changes: Any) -> None:
    config = json.loads((path / CONFIG).read_text())
    config.update(changes)
    (path / CONFIG).write_text(json.dumps(config))  # json writes NaN as PEFT would read it back


def _write_safetensors(path: Path, header: dict[str, Any], data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    (path / WEIGHTS).write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _replace(path: Path, make: Callable[[Path], None]) -> None:
    (path / WEIGHTS).unlink()
    make(path / WEIGHTS)


def _strict(text: str) -> Any:
    """Parse as strict JSON: Python's bare NaN/Infinity is refused, as jq or JavaScript refuse it."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _run(argv: list[str], unblock: Path | None = None) -> int:
    """``main(argv)`` under a bound: a blocked open fails the test instead of hanging it."""
    result: list[Any] = []

    def target() -> None:
        try:
            result.append(main(argv))
        except BaseException as exc:  # a traceback is a failure too: re-raised below
            result.append(exc)

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(BOUND_S)
    if worker.is_alive() and unblock is not None:
        os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))  # the writer side: its open() returns
    assert not worker.is_alive(), f"inspect still blocked after {BOUND_S} s on {argv}"
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


# name -> (break the saved folder, the error type, a fragment of the message)
GARBAGE: dict[str, tuple[Callable[[Path], None], str, str]] = {
    # item 21 as found: each gave a traceback, exit 1 and no JSON
    "config is a JSON list": (lambda p: (p / CONFIG).write_text("[1, 2]"), "ConfigError", "holds a JSON list, not the object"),
    "r is a string": (lambda p: _edit_config(p, r="8"), "ConfigError", 'r="8"; r must be a JSON integer'),
    "rank_pattern is a list": (lambda p: _edit_config(p, rank_pattern=["q_proj"]), "ConfigError", "rank_pattern must be a JSON object"),
    "truncated weights": (
        lambda p: (p / WEIGHTS).write_bytes((p / WEIGHTS).read_bytes()[:-100]),
        "AdapterError",
        "not a valid safetensors file: the tensors cover",
    ),
    "header lies about offsets": (
        lambda p: _write_safetensors(p, {f"{ATTN}.q_proj.lora_A.weight": _entry("F32", [8, 4], 0, 10**9)}, bytes(128)),
        "AdapterError",
        "data_offsets [0, 1000000000] do not hold shape [8, 4]",
    ),
    "0-d tensor": (
        lambda p: _write_safetensors(p, {f"{ATTN}.q_proj.lora_A.weight": _entry("F32", [], 0, 4), f"{ATTN}.q_proj.lora_B.weight": _entry("F32", [4, 1], 4, 20)}, bytes(20)),
        "ShapeMismatchError",
        "has shape []: a LoRA factor is 2-D",
    ),
    # more of the same
    "empty config": (lambda p: (p / CONFIG).write_text(""), "ConfigError", "adapter_config.json is empty"),
    "non-UTF-8 config": (lambda p: (p / CONFIG).write_bytes(b'{"r": 8, "x": "\xff\xfe"}'), "ConfigError", "is not UTF-8 JSON"),
    "config not JSON": (lambda p: (p / CONFIG).write_text("r = 8\n"), "ConfigError", "is not UTF-8 JSON"),
    "config nests 900 deep": (lambda p: (p / CONFIG).write_text('{"r": 8, "x": ' + "[" * 900 + "]" * 900 + "}"), "ConfigError", "nests deeper than"),
    "r is true": (lambda p: _edit_config(p, r=True), "ConfigError", "r=true; r must be a JSON integer"),
    "empty weights file": (lambda p: (p / WEIGHTS).write_bytes(b""), "AdapterError", "0 bytes, too short"),
    "huge header length": (
        lambda p: (p / WEIGHTS).write_bytes(struct.pack("<Q", 2**63) + (p / WEIGHTS).read_bytes()[8:]),
        "AdapterError",
        "header length 9223372036854775808 does not fit",
    ),
    "header not UTF-8": (lambda p: (p / WEIGHTS).write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{["), "AdapterError", "header is not UTF-8 JSON"),
    "overlapping tensors": (
        lambda p: _write_safetensors(p, {f"{ATTN}.q_proj.lora_A.weight": _entry("F32", [8, 4], 0, 128), f"{ATTN}.q_proj.lora_B.weight": _entry("F32", [4, 8], 0, 128)}, bytes(128)),
        "AdapterError",
        "(a gap or an overlap)",
    ),
    "a dimension of 2**70": (
        lambda p: _write_safetensors(p, {f"{ATTN}.q_proj.lora_A.weight": _entry("F32", [0, 2**70], 0, 0)}),
        "AdapterError",
        "is larger than any tensor can be",
    ),
    "a directory as the weights file": (lambda p: _replace(p, Path.mkdir), "StorageError", "adapter_model.safetensors is a directory, not a regular file"),
    "a directory as the config": (lambda p: ((p / CONFIG).unlink(), (p / CONFIG).mkdir()), "StorageError", "adapter_config.json is a directory"),
    "weights symlinked to /dev/zero": (lambda p: _replace(p, lambda w: w.symlink_to("/dev/zero")), "StorageError", "is a device, not a regular file"),
    "weights file is a FIFO": (lambda p: _replace(p, os.mkfifo), "StorageError", "is a FIFO, not a regular file"),
    "config is a FIFO": (lambda p: ((p / CONFIG).unlink(), os.mkfifo(p / CONFIG)), "StorageError", "adapter_config.json is a FIFO"),
    "weights symlink loop": (lambda p: _replace(p, lambda w: w.symlink_to(w)), "StorageError", "cannot open"),
    "1-D factor": (
        lambda p: _write_safetensors(p, {f"{ATTN}.q_proj.lora_A.weight": _entry("F32", [8], 0, 32), f"{ATTN}.q_proj.lora_B.weight": _entry("F32", [4, 8], 32, 160)}, bytes(160)),
        "ShapeMismatchError",
        "has shape [8]: a LoRA factor is 2-D",
    ),
    "a dtype lorasync does not read": (
        lambda p: _write_safetensors(p, {f"{ATTN}.q_proj.lora_A.weight": _entry("U16", [8, 4], 0, 64)}, bytes(64)),
        "AdapterError",
        "dtype 'U16' is none lorasync reads",
    ),
}


@pytest.mark.parametrize("case", list(GARBAGE))
def test_garbage_gives_a_typed_error_exit_2_and_strict_json(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _saved(tmp_path)
    breaker, error, fragment = GARBAGE[case]
    breaker(path)
    fifo = next((f for f in (path / WEIGHTS, path / CONFIG) if f.is_fifo()), None)

    assert _run(["inspect", str(path), "--json"], unblock=fifo) == 2
    out = capsys.readouterr()
    doc = _strict(out.out)
    assert doc["ok"] is False and doc["exit_code"] == 2
    assert doc["error"]["type"] == error, doc
    assert fragment in doc["error"]["message"], doc["error"]["message"]
    assert "Traceback" not in out.err

    assert _run(["inspect", str(path)], unblock=fifo) == 2
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {error}: ") and fragment in lines[0], out.err


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["inspect", "/nonexistent/adapter"], "/nonexistent/adapter does not exist"),
        (["inspect", "/dev/zero"], "/dev/zero is not a directory"),
        (["inspect", "PATH", "--vllm-max-rank", "0"], "--vllm-max-rank must be a positive integer"),
    ],
)
def test_paths_and_options_that_are_no_adapter_exit_2(argv: list[str], fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(_saved(tmp_path)) if a == "PATH" else a for a in argv]
    assert _run([*argv, "--json"]) == 2
    doc = _strict(capsys.readouterr().out)
    assert doc["error"]["type"] == "ConfigError" and fragment in doc["error"]["message"]


def _nan_alpha(p: Path) -> None:
    _edit_config(p, lora_alpha=float("nan"))


def _rank_zero(p: Path, r: int) -> None:
    _write_safetensors(p, {f"{ATTN}.q_proj.lora_A.weight": _entry("F32", [0, 64], 0, 0), f"{ATTN}.q_proj.lora_B.weight": _entry("F32", [64, 0], 0, 0)})
    _edit_config(p, r=r)


def _mixed_dtypes(p: Path) -> None:
    a, b = f"{ATTN}.q_proj.lora_A.weight", f"{ATTN}.q_proj.lora_B.weight"
    _write_safetensors(p, {a: _entry("F32", [8, 4], 0, 128), b: _entry("F16", [4, 8], 128, 192)}, bytes(192))


# name -> (break the saved folder, what Adapter.load raises, a fragment of its message)
REFUSED_BY_LORASYNC: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "lora_alpha NaN": (_nan_alpha, "ConfigError", "lora_alpha must be a finite number, got nan"),
    "lora_alpha -8": (lambda p: _edit_config(p, lora_alpha=-8), "ConfigError", "lora_alpha must be > 0, got -8"),
    "rank-0 factors, r=0": (lambda p: _rank_zero(p, 0), "ConfigError", "r must be a positive int, got 0"),
    "rank-0 factors, r=8": (lambda p: _rank_zero(p, 8), "ShapeMismatchError", "do not match rank 8"),
    "mixed dtypes": (_mixed_dtypes, "DtypeMismatchError", "is torch.float16 but"),
    "a second safetensors file": (lambda p: (p / "extra.safetensors").write_bytes((p / WEIGHTS).read_bytes()), "AdapterError", "holds weight files besides"),
    "integer factors": (
        lambda p: _write_safetensors(p, {f"{ATTN}.q_proj.lora_A.weight": _entry("I32", [8, 4], 0, 128), f"{ATTN}.q_proj.lora_B.weight": _entry("I32", [4, 8], 128, 256)}, bytes(256)),
        "DtypeMismatchError",
        "has non-floating dtype torch.int32",
    ),
    "no tensors at all": (lambda p: _write_safetensors(p, {}), "AdapterError", "an adapter needs at least one lora_A/lora_B pair"),
}


@pytest.mark.parametrize("case", list(REFUSED_BY_LORASYNC))
def test_what_lorasync_refuses_every_engine_refuses(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _saved(tmp_path)
    breaker, error, fragment = REFUSED_BY_LORASYNC[case]
    breaker(path)
    with pytest.raises(Exception) as refused:  # what publish does with the folder
        Adapter.load(path)
    assert type(refused.value).__name__ == error and fragment in str(refused.value)

    assert _run(["inspect", str(path), "--json"]) == 1
    doc = _strict(capsys.readouterr().out)
    assert doc["verdicts"] == dict.fromkeys(ENGINES, "refused")
    assert doc["ok"] is False and doc["exit_code"] == 1
    said = [f["message"] for f in doc["findings"] if f["engine"] == "all" and f["level"] == "error" and "lorasync refuses" in f["message"]]
    if case != "a second safetensors file":  # inspect words that one itself (Adapter.load checks it before reading)
        assert any(f"(Adapter.load raises {error})" in m and fragment in m for m in said), doc["findings"]
    assert said, doc["findings"]

    assert _run(["inspect", str(path)]) == 1
    text = capsys.readouterr().out
    assert all(f"  {engine:<7} refused" in text for engine in ENGINES), text


def test_nan_lora_alpha_is_written_as_a_json_string(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _saved(tmp_path)
    _edit_config(path, lora_alpha=float("nan"), alpha_pattern={"q_proj": float("inf")})
    assert _run(["inspect", str(path), "--json"]) == 1
    doc = _strict(capsys.readouterr().out)
    assert doc["config"]["lora_alpha"] == "NaN" and doc["config"]["alpha_pattern"] == {"q_proj": "Infinity"}


def test_an_adapter_lorasync_loads_has_no_lorasync_finding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _saved(tmp_path)
    Adapter.load(path)
    assert _run(["inspect", str(path), "--json"]) == 0
    doc = _strict(capsys.readouterr().out)
    assert doc["verdicts"] == dict.fromkeys(ENGINES, "loads")
    assert not any("lorasync refuses" in f["message"] for f in doc["findings"])
