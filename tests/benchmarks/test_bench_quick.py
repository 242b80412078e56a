"""The benchmark suite: computed bytes equal what lorasync's transports actually move, the shipped
model shapes are the public models, and ``lorasync bench`` runs end to end writing JSON + PNG.
No timing assertions."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks._shapes import ModelShape, available_shapes
from benchmarks.bytes import measure_bytes


@pytest.mark.parametrize("scope", ["all-linear", "attention"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_computed_bytes_equal_bytes_moved_by_every_transport(scope, dtype, tmp_path):
    shape = ModelShape.load("tiny")
    result = measure_bytes(shape, rank=4, scope=scope, dtype=dtype, root=tmp_path)
    computed, measured = result["computed"], result["measured"]
    assert computed["adapter"] == shape.adapter_bytes(4, scope, dtype) > 0
    assert measured["disk_data"] == measured["shm_data"] == measured["ipc_reported"] == computed["adapter"]
    assert measured["merged_pushed"] == measured["merged_reported"] == computed["merged"]
    # Files and segments carry a header on top of the tensor bytes, never less.
    assert measured["disk_files"] > measured["disk_data"] and measured["shm_segment"] > measured["shm_data"]


def test_moe_experts_travel_with_their_computed_bytes(tmp_path):
    config = {
        "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100, "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = ModelShape.load(tmp_path)
    assert sum(".mlp.experts." in m.path for m in shape.linears()) == 2 * 4 * 3
    result = measure_bytes(shape, rank=2, scope="all-linear", dtype=torch.bfloat16, root=tmp_path / "store")
    per_layer = (64 + 64) + 2 * (64 + 32) + (64 + 64) + 4 * 3 * (64 + 32)  # q, k+v, o, 4 experts x gate/up/down
    layers, rank, bf16 = 2, 2, 2
    assert result["measured"]["disk_data"] == result["computed"]["adapter"] == layers * rank * bf16 * per_layer


@pytest.mark.parametrize(
    ("name", "params_b"),
    [("qwen3-0.6b", 0.596), ("qwen3-8b", 8.19), ("llama-3.1-8b", 8.03), ("qwen2.5-32b", 32.76), ("llama-3.1-70b", 70.55), ("qwen3-30b-a3b", 30.53)],
)
def test_shipped_shapes_are_the_public_models(name, params_b):
    shape = ModelShape.load(name)
    params = shape.model_bytes() / shape.dtype.itemsize
    assert params == pytest.approx(params_b * 1e9, rel=0.005)
    assert name in available_shapes()


def test_qwen3_8b_r16_all_linear_adapter_is_87_mb():
    assert ModelShape.load("Qwen/Qwen3-8B").adapter_bytes(16, "all-linear", torch.bfloat16) == 87_293_952


def test_bench_cli_runs_one_tiny_configuration_and_writes_json_and_png(tmp_path, capsys):
    from lorasync.cli import main

    out = tmp_path / "out"
    code = main(["bench", "bytes", "--quick", "--shape", "tiny", "--rank", "2,4", "--out", str(out), "--no-progress", "--root", str(tmp_path / "shm")])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| tiny | 4 |" in printed and "Computed vs measured" in printed
    payload = json.loads((out / "bytes.json").read_text())
    assert payload["benchmark"] == "bytes" and payload["goals"][0]["met"]
    assert [e["rank"] for e in payload["data"]["computed"]] == [2, 4]
    assert (out / "bytes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "bytes.md").read_text().startswith("### Sync payload")


def test_bench_cli_rejects_an_unknown_benchmark(tmp_path, capsys):
    from lorasync.cli import main

    assert main(["bench", "latency", "--out", str(tmp_path)]) == 2  # bad input (lorasync.cli._common)
    assert "unknown benchmark latency" in capsys.readouterr().err
