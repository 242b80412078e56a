"""Validation at the Megatron exporters' public entry (issue 28, items 7, 19 and 23).

Layer offsets must partition the base model's layers in pipeline order, or an adapter with its
layers swapped is exported; a grid much larger than the shards given is refused by arithmetic,
never built; option values of the wrong kind (a bool, a float, NaN) are refused with a typed error
that names the argument, never a bare torch ``TypeError`` from deep inside the gather.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from _shard_builder import build_shards, config, make_peft

from lorasync.errors import ConfigError, ExportError, GeometryError, MissingShardError
from lorasync.exporters.megatron import ShardKey, export, export_distributed


def _exact(adapter, peft):
    return sorted(adapter.tensors) == sorted(peft) and all(torch.equal(adapter.tensors[k], v) for k, v in peft.items())


def _restage(flat, stages):
    """Split one stage's shard into pipeline stages: ``stages`` lists each stage's global layers."""
    out = {}
    for pp, layers in enumerate(stages):
        out[(pp, 0)] = {
            k.replace(f"decoder.layers.{g}.", f"decoder.layers.{g - layers[0]}."): v
            for g in layers
            for k, v in flat.items()
            if k.startswith(f"decoder.layers.{g}.")
        }
    return out


def test_layer_offsets_out_of_pipeline_order_are_refused():
    cfg = config(layers=4)
    peft = make_peft(cfg, r=4, seed=1)
    shards = build_shards(peft, cfg, pp=2)
    # Before: accepted, and stage 0's layers came out as layers 2-3 (a layer-swapped adapter).
    with pytest.raises(GeometryError, match=r"pipeline order.*even split is \[0, 2\]") as info:
        export(shards, base_config=cfg, alpha=8, layer_offsets=[2, 0])
    assert isinstance(info.value, ExportError)
    # The mapping form, with virtual pipeline chunks: chunk vp 0 of every PP rank precedes vp 1.
    cfg8 = config(layers=8)
    flat = build_shards(make_peft(cfg8, r=4, seed=2), cfg8)[(0, 0)]
    vpp = {}
    for pp in range(2):
        for vp in range(2):
            first = vp * 4 + pp * 2
            vpp[ShardKey(pp=pp, tp=0, vp=vp)] = _restage(flat, [range(first, first + 2)])[(0, 0)]
    swapped = {(0, 0): 0, (1, 0): 4, (0, 1): 2, (1, 1): 6}  # pp-major: Megatron's order is vp-major
    with pytest.raises(GeometryError, match="pipeline order"):
        export(vpp, base_config=cfg8, alpha=8, layer_offsets=swapped)
    good = {(0, 0): 0, (1, 0): 2, (0, 1): 4, (1, 1): 6}
    assert _exact(export(vpp, base_config=cfg8, alpha=8, layer_offsets=good), make_peft(cfg8, r=4, seed=2))


def test_layer_offsets_that_leave_a_gap_are_refused():
    # LoRA on layers 0-2 of a 4-layer model, stages [0, 1] and [2, 3]: stage 1 holds local layer 0 only.
    cfg = config(layers=4)
    peft = make_peft(cfg, r=4, seed=3)
    flat = build_shards(peft, cfg)[(0, 0)]
    shards = _restage({k: v for k, v in flat.items() if not k.startswith("decoder.layers.3.")}, [range(0, 2), range(2, 3)])
    want = {k: v for k, v in peft.items() if ".layers.3." not in k}
    assert _exact(export(shards, base_config=cfg, alpha=8, layer_offsets=[0, 2]), want)
    # 1-based offsets leave layer 0 to no stage. Before: accepted, every layer shifted by one.
    with pytest.raises(GeometryError, match="first stage must start at layer 0"):
        export(shards, base_config=cfg, alpha=8, layer_offsets=[1, 3])
    # An offset past the model's end.
    with pytest.raises(GeometryError, match="partition the base model's 4 layers"):
        export(shards, base_config=cfg, alpha=8, layer_offsets=[0, 5])


def test_a_stage_that_runs_into_the_next_is_refused():
    cfg = config(layers=4)
    shards = build_shards(make_peft(cfg, r=4, seed=4), cfg, pp=2)
    with pytest.raises(GeometryError, match=r"local layer 1 of a stage that holds global layers 0\.\.0"):
        export(shards, base_config=cfg, alpha=8, layer_offsets=[0, 1])
    with pytest.raises(GeometryError, match="holds global layers none"):  # stage 1 is empty under [0, 4]
        export(shards, base_config=cfg, alpha=8, layer_offsets=[0, 4])


def test_an_empty_stage_is_a_valid_layout():
    # Megatron layouts whose first stage holds only the embedding: equal offsets, an empty shard.
    cfg = config(layers=4)
    peft = make_peft(cfg, r=4, seed=5)
    flat = build_shards(peft, cfg)[(0, 0)]
    shards = {(0, 0): {}, (1, 0): flat}
    assert _exact(export(shards, base_config=cfg, alpha=8, layer_offsets=(0, 0)), peft)
    assert _exact(export(shards, base_config=cfg, alpha=8, layer_offsets={0: np.int64(0), 1: 0}), peft)


@pytest.mark.parametrize(
    "offsets, error, match",
    [
        ("0,2", ConfigError, "list of ints"),
        ([0, True], ConfigError, r"layer_offsets\[1\] must be a non-negative int"),
        ([0, 2.0], ConfigError, r"layer_offsets\[1\]"),
        ([0, -2], ConfigError, r"layer_offsets\[1\]"),
        ([0, 1, 2], GeometryError, r"3 offset\(s\) but the shards span PP=2"),
        ([0], GeometryError, r"1 offset\(s\) but the shards span PP=2"),
        ({0: 0, 1: 2, 2: 3}, GeometryError, r"stages \[\(2, 0\)\]"),
        ({0: 0, (0, 0): 0, 1: 2}, ConfigError, "twice"),
        ({"0": 0, 1: 2}, ConfigError, "keys must be a PP rank"),
        (7, ConfigError, "list of ints"),
    ],
)
def test_malformed_layer_offsets_are_typed(offsets, error, match):
    cfg = config(layers=4)
    shards = build_shards(make_peft(cfg, r=4, seed=6), cfg, pp=2)
    with pytest.raises(error, match=match):
        export(shards, base_config=cfg, alpha=8, layer_offsets=offsets)


@pytest.mark.parametrize("sizes", [{"tp_size": 10**6}, {"pp_size": 10**5, "ep_size": 10}])
def test_a_huge_grid_is_refused_before_anything_is_allocated(sizes):
    cfg = config()
    shards = build_shards(make_peft(cfg, r=4, seed=7), cfg, tp=2)
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(MissingShardError) as info:
            export(shards, base_config=cfg, alpha=8, **sizes)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Before: tp_size=10**6 built two million ShardKeys (~0.5 GB) before refusing.
    assert peak < 4 * 2**20, f"the refusal allocated {peak / 2**20:.1f} MiB"
    assert time.monotonic() - started < 10
    assert re.search(r"of the \d+ shard\(s\) .* are missing \(2 given\)", str(info.value))
    assert "tp_size/pp_size/ep_size" in str(info.value)
    assert len(info.value.missing) == 8 and all(isinstance(k, ShardKey) for k in info.value.missing)


_HUGE = """
import resource, sys
sys.path.insert(0, {here!r})
from _shard_builder import build_shards, config, make_peft
from lorasync.errors import MissingShardError
from lorasync.exporters.megatron import export
cfg = config()
shards = build_shards(make_peft(cfg, r=4, seed=7), cfg, tp=2)
soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
resource.setrlimit(resource.RLIMIT_DATA, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 + 2**30, hard))
for sizes in ({{"tp_size": 10**7}}, {{"tp_size": 10**12, "ep_size": 10**12}}):
    try:
        export(shards, base_config=cfg, alpha=8, **sizes)
    except MissingShardError as exc:
        print("refused", str(exc)[:40])
"""


def test_a_grid_of_ten_million_shards_is_refused_without_running_out_of_memory():
    # In a child whose heap may grow 1 GiB at most: before, tp_size=10**7 raised MemoryError there
    # (and took the whole machine's memory without the limit); 10**12 never finished.
    code = _HUGE.format(here=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("refused") == 2, done.stdout


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "option, value",
    [
        ("rank", True), ("rank", 0), ("rank", -4), ("rank", 4.0), ("rank", "4"),
        ("tp_size", 1.0), ("tp_size", True), ("tp_size", 0), ("tp_size", -2),
        ("pp_size", True), ("pp_size", 0), ("ep_size", 0), ("ep_size", 2.5),
        ("alpha", NAN), ("alpha", INF), ("alpha", -INF), ("alpha", True), ("alpha", 0), ("alpha", -8),
        ("alpha", "8"), ("alpha", None),
        ("slot", True), ("slot", -1), ("slot", 1.0),
        ("dtype", "bf16"), ("dtype", torch.int8), ("lora_type", "LoRA"), ("lora_type", None),
    ],
)  # fmt: skip
def test_option_values_of_the_wrong_kind_are_typed_and_named(option, value):
    cfg = config()
    shards = build_shards(make_peft(cfg, r=4, seed=8), cfg, tp=2)
    kwargs = {"base_config": cfg, "alpha": 8, option: value}
    # Before: rank=True, tp_size=1.0/True ended in bare torch TypeErrors, tp_size=0 meant "infer".
    with pytest.raises(ConfigError, match=option) as info:
        export(shards, **kwargs)
    assert not isinstance(info.value, TypeError)
    # export_distributed checks the same values before it needs a process group (it has no *_size).
    if not option.endswith("_size"):
        with pytest.raises(ConfigError, match=option):
            export_distributed(shards[(0, 0)], **kwargs)


def test_export_distributed_refuses_a_bool_dst():
    with pytest.raises(ConfigError, match="dst"):
        export_distributed({}, base_config=config(), alpha=8, dst=True)


def test_numpy_scalars_are_plain_numbers():
    cfg = config()
    peft = make_peft(cfg, r=4, seed=9)
    shards = build_shards(peft, cfg, tp=2, max_rank=8)
    adapter = export(shards, base_config=cfg, alpha=np.float32(8), rank=np.int64(4), tp_size=np.int64(2))
    assert _exact(adapter, peft)
    assert type(adapter.config.r) is int and type(adapter.config.lora_alpha) is float


@pytest.mark.parametrize("key", [(True, 0), (0, False), (0.0, 0)])
def test_bool_and_float_shard_keys_are_refused(key):
    with pytest.raises(ConfigError, match="shard key"):
        export({key: {}}, base_config=config(), alpha=8)


def test_shards_and_states_that_are_not_mappings_are_typed():
    cfg = config()
    shards = build_shards(make_peft(cfg, r=4, seed=10), cfg)
    with pytest.raises(ConfigError, match="shards must be a mapping"):
        export(list(shards.items()), base_config=cfg, alpha=8)
    with pytest.raises(ConfigError, match="state dict"):
        export({(0, 0): list(shards[(0, 0)].items())}, base_config=cfg, alpha=8)
    meta = {k: v.to("meta") for k, v in shards[(0, 0)].items()}
    with pytest.raises(ExportError, match="meta tensor"):
        export({(0, 0): meta}, base_config=cfg, alpha=8)


@pytest.mark.parametrize(
    "content, match",
    [
        (json.dumps([1, 2]), "JSON object"),
        (json.dumps({**config(), "num_key_value_heads": "x"}), "num_key_value_heads must be an int"),
        (json.dumps({**config(), "num_hidden_layers": True}), "num_hidden_layers must be an int"),
        (json.dumps({**config(), "num_experts": "8"}), "num_experts must be an int"),
        (json.dumps({"hidden_size": 32}), "lacks"),
    ],
)
def test_malformed_base_configs_are_typed(tmp_path, content, match):
    cfg = config()
    shards = build_shards(make_peft(cfg, r=4, seed=11), cfg)
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ConfigError, match=match):
        export(shards, base_config=tmp_path, alpha=8)


def test_a_binary_base_config_is_typed(tmp_path):
    cfg = config()
    shards = build_shards(make_peft(cfg, r=4, seed=12), cfg)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="not valid JSON"):
        export(shards, base_config=tmp_path, alpha=8)
