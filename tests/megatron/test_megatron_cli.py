"""``lorasync export megatron``: parse real arguments, run the handler on files, load the result."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from _shard_builder import build_shards, config, make_peft
from safetensors.torch import save_file

from lorasync import Adapter
from lorasync.cli.export import register
from lorasync.errors import MissingShardError, StorageError


def _parse(argv):
    parser = argparse.ArgumentParser(prog="lorasync")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def _write_config(tmp_path, cfg):
    path = tmp_path / "base" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    return path


def test_safetensors_shards_to_adapter_dir(tmp_path, capsys):
    cfg = config(layers=4)
    peft = make_peft(cfg, r=5, seed=4)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for (pp, tp), state in build_shards(peft, cfg, tp=2, pp=2, max_rank=8).items():
        save_file(state, str(ckpt / f"mp_rank_{tp:02d}_{pp:03d}.safetensors"))
    save_file({"x": torch.zeros(1)}, str(ckpt / "mp_rank_1_000.safetensors"))  # wrong padding: ignored
    args = _parse([
        "export", "megatron", "--shards", str(ckpt / "mp_rank_{tp:02d}_{pp:03d}.safetensors"),
        "--base-config", str(_write_config(tmp_path, cfg).parent), "--rank", "5", "--alpha", "10",
        "--out", str(tmp_path / "out"), "--tp-size", "2",
    ])
    assert args.func(args) == 0
    assert "from 4 shard files" in capsys.readouterr().out
    adapter = Adapter.load(tmp_path / "out")
    assert adapter.config.r == 5 and adapter.config.lora_alpha == 10
    assert sorted(adapter.tensors) == sorted(peft)
    assert all(torch.equal(adapter.tensors[k], v) for k, v in peft.items())


def test_pt_shards_with_legacy_model_wrapper(tmp_path):
    cfg = config()
    peft = make_peft(cfg, r=4, seed=5)
    for (pp, tp), state in build_shards(peft, cfg, tp=2).items():
        rank_dir = tmp_path / f"mp_rank_{tp:02d}"
        rank_dir.mkdir()
        torch.save({"model": state, "checkpoint_version": 3.0}, rank_dir / "model_optim_rng.pt")
    args = _parse([
        "export", "megatron", "--shards", str(tmp_path / "mp_rank_{tp:02d}" / "model_optim_rng.pt"),
        "--base-config", str(_write_config(tmp_path, cfg)), "--alpha", "8", "--out", str(tmp_path / "out"),
        "--dtype", "bfloat16",
    ])
    assert args.func(args) == 0
    adapter = Adapter.load(tmp_path / "out")
    assert adapter.dtype == torch.bfloat16
    assert all(torch.equal(adapter.tensors[k], v.to(torch.bfloat16)) for k, v in peft.items())


def test_no_matching_files(tmp_path):
    args = _parse([
        "export", "megatron", "--shards", str(tmp_path / "rank_{tp}.safetensors"), "--base-config", "x",
        "--alpha", "8", "--out", str(tmp_path / "out"),
    ])
    with pytest.raises(MissingShardError, match="no file matches"):
        args.func(args)


def test_pickled_objects_are_refused(tmp_path):
    torch.save({"model": {}, "args": argparse.Namespace(tp=2)}, tmp_path / "rank_0.pt")
    args = _parse([
        "export", "megatron", "--shards", str(tmp_path / "rank_{tp}.pt"), "--base-config", "x",
        "--alpha", "8", "--out", str(tmp_path / "out"),
    ])
    with pytest.raises(StorageError, match="only tensors"):
        args.func(args)
