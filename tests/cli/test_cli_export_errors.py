"""``lorasync export megatron`` with the inputs a careless user types (issue 28, item 22).

Every failure ends as a typed lorasync error: exit code 2 (bad input), one valid JSON document
with ``--json``, one ``error: <Type>: ...`` line without it, never a traceback, and no output
directory left behind. Shards are written with the independent inverse in
``tests/megatron/_shard_builder.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from lorasync import Adapter
from lorasync.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "megatron"))
from _shard_builder import build_shards, config, make_peft  # noqa: E402 - independent inverse of the exporter


@pytest.fixture
def ckpt(tmp_path: Path) -> dict[str, Any]:
    """A 4-layer model's shards at TP=2 x PP=2 as ``sh_{tp}_{pp}.safetensors``, and its config."""
    cfg = config(layers=4)
    peft = make_peft(cfg, r=4, seed=1)
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "ck").mkdir()
    for (pp, tp), state in build_shards(peft, cfg, tp=2, pp=2).items():
        save_file(state, str(tmp_path / "ck" / f"sh_{tp}_{pp}.safetensors"))
    return {"dir": tmp_path, "peft": peft, "base": str(tmp_path / "base"), "out": tmp_path / "out"}


def _run(capsys: pytest.CaptureFixture[str], ckpt: dict[str, Any], shards: str, *extra: str, json_out: bool = True) -> tuple[int, Any, str]:
    argv = ["export", "megatron", "--shards", shards, "--base-config", ckpt["base"], "--alpha", "8", "--out", str(ckpt["out"]), *extra]
    code = main([*argv, "--json"] if json_out else argv)
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if json_out else captured.out, captured.err


def _refused(capsys: pytest.CaptureFixture[str], ckpt: dict[str, Any], shards: str, *extra: str, error: str, match: str) -> None:
    code, doc, _ = _run(capsys, ckpt, shards, *extra)
    assert code == 2, doc
    assert doc["ok"] is False and doc["exit_code"] == 2 and doc["error"]["type"] == error, doc
    assert match in doc["error"]["message"], doc["error"]["message"]
    assert not ckpt["out"].exists(), "a refused export left its output directory behind"
    code, out, err = _run(capsys, ckpt, shards, *extra, json_out=False)
    assert code == 2 and err.startswith(f"error: {error}: ") and "Traceback" not in err and out == ""


@pytest.mark.parametrize(
    "name, error, match",
    [
        ("sh_{tp:s}_{pp}.safetensors", "ConfigError", "{tp:s} cannot format a rank"),  # was: ValueError traceback
        ("sh_{tp:3d}_{pp}.safetensors", "ConfigError", "writes rank 0 as '  0'"),
        ("sh_{tp:c}_{pp}.safetensors", "ConfigError", "{tp:c}"),
        ("sh_{tp:{pp}}.safetensors", "ConfigError", "{tp:{pp}}"),
        ("sh_{foo}_{pp}.safetensors", "ConfigError", "has the placeholder {foo}"),
        ("sh_{}_{pp}.safetensors", "ConfigError", "has the placeholder {}"),
        ("sh_{0}_{pp}.safetensors", "ConfigError", "has the placeholder {0}"),
        ("sh_{tp!r}_{pp}.safetensors", "ConfigError", "has the placeholder {tp!r}"),
        ("sh_{tp.real}_{pp}.safetensors", "ConfigError", "{tp.real}"),
        ("sh_{tp_{pp}.safetensors", "ConfigError", "is not a valid pattern"),
        ("sh_{tp}_{pp.safetensors", "ConfigError", "is not a valid pattern"),
        ("sh_}{tp}_{pp}.safetensors", "ConfigError", "Single '}'"),
        ("zz_{tp}_{pp}.safetensors", "MissingShardError", "no file matches"),
        ("sh_{tp}.safetensors", "MissingShardError", "no file matches"),
    ],
)
def test_a_bad_shards_pattern_is_a_typed_error(capsys: pytest.CaptureFixture[str], ckpt: dict[str, Any], name: str, error: str, match: str) -> None:
    _refused(capsys, ckpt, str(ckpt["dir"] / "ck" / name), error=error, match=match)


def test_an_empty_pattern_and_an_empty_out_are_typed(capsys: pytest.CaptureFixture[str], ckpt: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    _refused(capsys, ckpt, "", error="MissingShardError", match="no file matches")
    monkeypatch.chdir(ckpt["dir"])
    code, doc, _ = _run(capsys, ckpt, str(ckpt["dir"] / "ck" / "sh_{tp}_{pp}.safetensors"), "--out", "")
    assert code == 2 and doc["error"]["type"] == "ConfigError" and "--out is empty" in doc["error"]["message"]
    assert not (ckpt["dir"] / "adapter_model.safetensors").exists()  # an unset $OUT did not write into the cwd


def _bad_file(kind: str, path: Path, good: bytes) -> None:
    if kind == "not_safetensors":
        path.write_bytes(b"this is not a safetensors file")
    elif kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge_header":
        path.write_bytes((2**62).to_bytes(8, "little") + b"{}")


@pytest.mark.parametrize("kind", ["not_safetensors", "truncated", "empty", "directory", "huge_header"])
def test_an_unreadable_shard_file_is_a_typed_error(capsys: pytest.CaptureFixture[str], ckpt: dict[str, Any], kind: str) -> None:
    bad = ckpt["dir"] / "ck" / "sh_1_1.safetensors"
    good = bad.read_bytes()
    bad.unlink()
    _bad_file(kind, bad, good)
    _refused(capsys, ckpt, str(ckpt["dir"] / "ck" / "sh_{tp}_{pp}.safetensors"), error="StorageError", match="cannot read shard")


@pytest.mark.parametrize("content", [b"garbage", b"PK\x03\x04truncated zip"])
def test_an_unreadable_pt_shard_is_a_typed_error(capsys: pytest.CaptureFixture[str], ckpt: dict[str, Any], content: bytes) -> None:
    (ckpt["dir"] / "pt").mkdir()
    (ckpt["dir"] / "pt" / "rank_0.pt").write_bytes(content)
    _refused(capsys, ckpt, str(ckpt["dir"] / "pt" / "rank_{tp}.pt"), error="StorageError", match="cannot read shard")


@pytest.mark.parametrize(
    "extra, error, match",
    [
        (["--layer-offsets", "2,0"], "GeometryError", "pipeline order"),  # item 7 through the CLI
        (["--layer-offsets", "0,-2"], "ConfigError", "layer_offsets[1]"),
        (["--layer-offsets", "0,2,"], "ConfigError", "comma-separated integers"),
        (["--tp-size", "0"], "ConfigError", "tp_size must be an int >= 1"),  # was: 0 silently meant "infer"
        (["--tp-size", "1000000000"], "MissingShardError", "(4 given)"),  # item 19 through the CLI
        (["--alpha", "nan"], "ConfigError", "alpha must be a finite number"),
        (["--alpha", "inf"], "ConfigError", "alpha must be a finite number"),
        (["--alpha", "-8"], "ConfigError", "alpha must be a finite number > 0"),
        (["--rank", "0"], "ConfigError", "rank must be an int >= 1"),
        (["--slot", "-1"], "ConfigError", "slot must be an int >= 0"),
    ],
)
def test_bad_option_values_are_typed(capsys: pytest.CaptureFixture[str], ckpt: dict[str, Any], extra: list[str], error: str, match: str) -> None:
    _refused(capsys, ckpt, str(ckpt["dir"] / "ck" / "sh_{tp}_{pp}.safetensors"), *extra, error=error, match=match)


@pytest.mark.parametrize(
    "content, match",
    [
        ("[1, 2]", "JSON object"),  # was: AttributeError traceback
        (json.dumps({**config(layers=4), "num_key_value_heads": "x"}), "num_key_value_heads must be an int"),  # was: ValueError traceback
        ("{not json", "not valid JSON"),
    ],
)
def test_a_malformed_base_config_is_typed(capsys: pytest.CaptureFixture[str], ckpt: dict[str, Any], content: str, match: str) -> None:
    (ckpt["dir"] / "base" / "config.json").write_text(content)
    _refused(capsys, ckpt, str(ckpt["dir"] / "ck" / "sh_{tp}_{pp}.safetensors"), error="ConfigError", match=match)


def test_unusual_but_valid_patterns_still_export_exactly(capsys: pytest.CaptureFixture[str], ckpt: dict[str, Any]) -> None:
    # Glob characters in a folder name are literal, a literal brace is '{{', a placeholder may repeat.
    odd = ckpt["dir"] / "run[1] {x}"
    odd.mkdir()
    for path in (ckpt["dir"] / "ck").iterdir():
        tp, pp = path.stem.split("_")[1:]
        (odd / f"tp{tp}").mkdir(exist_ok=True)
        (odd / f"tp{tp}" / f"sh_{tp}_{int(pp):02d}.safetensors").write_bytes(path.read_bytes())
    (odd / "tp1" / "sh_0_00.safetensors").write_bytes(b"decoy: tp folder and file disagree")
    pattern = str(ckpt["dir"] / "run[1] {{x}}" / "tp{tp}" / "sh_{tp}_{pp:02d}.safetensors")
    code, doc, _ = _run(capsys, ckpt, pattern, "--tp-size", "2")
    assert code == 0 and doc["ok"] is True and doc["shard_files"] == 4, doc
    adapter = Adapter.load(ckpt["out"])
    assert sorted(adapter.tensors) == sorted(ckpt["peft"])
    assert all(torch.equal(adapter.tensors[k], v) for k, v in ckpt["peft"].items())
