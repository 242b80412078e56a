"""The distributed publisher's wire formats and role checks, without processes: the adapter
buffer round-trips bit for bit and refuses corruption; results and errors survive JSON; a
misconfigured job is refused with the rule it broke."""

from __future__ import annotations

import json

import pytest
import torch
from _dist_publish_worker import make_adapter
from safetensors.torch import load

from lorasync import Probe
from lorasync.distributed._wire import decode_adapter, decode_error, decode_result, encode_error, encode_result
from lorasync.publisher._report import EngineResult
from lorasync.distributed import DistributedPublisher, encode_adapter
from lorasync.distributed._roles import resolve as _resolve
from lorasync.errors import (
    ConfigError,
    EngineUnavailableError,
    InvalidNameError,
    PublishError,
    ShapeMismatchError,
    TransportError,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_adapter_round_trips_bit_for_bit_with_probe(dtype):
    adapter = make_adapter(3, dtype)
    probe = Probe((5, 6, 7), (9, 10), (-0.25, -1.5), atol=0.01)
    buffer = encode_adapter(adapter, probe=probe)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    got, got_probe = decode_adapter(buffer)
    assert got_probe == probe
    assert got.config == adapter.config and got.content_hash == adapter.content_hash
    for key, tensor in adapter.tensors.items():
        assert got.tensors[key].dtype == dtype
        assert torch.equal(got.tensors[key].view(torch.uint8), tensor.view(torch.uint8))
    # a plain safetensors file: the metadata is JSON, no pickle
    assert sorted(load(buffer.numpy().tobytes())) == sorted(adapter.tensors)


def test_pattern_order_survives_the_wire():
    # PEFT matches rank/alpha patterns first-match in insertion order: "q_proj" must stay first.
    from lorasync import Adapter, AdapterConfig

    source = make_adapter(2)
    tensors = {k: (t[:2] if "v_proj.lora_A" in k else t[:, :2] if "v_proj.lora_B" in k else t) for k, t in source.tensors.items()}
    config = AdapterConfig(r=4, lora_alpha=8, rank_pattern={"v_proj": 2},
                           alpha_pattern={"q_proj": 5.0, "model.layers.0.self_attn.q_proj": 7.0})
    adapter = Adapter(tensors, config)
    got, _ = decode_adapter(encode_adapter(adapter))
    assert list(got.config.alpha_pattern) == ["q_proj", "model.layers.0.self_attn.q_proj"]
    assert got.config.alpha_for("model.layers.0.self_attn.q_proj") == adapter.config.alpha_for("model.layers.0.self_attn.q_proj")
    assert got.content_hash == adapter.content_hash


def test_without_probe_decodes_none():
    assert decode_adapter(encode_adapter(make_adapter(1)))[1] is None


def test_corrupt_or_truncated_buffer_is_refused():
    adapter = make_adapter(1)
    buffer = encode_adapter(adapter)
    flipped = buffer.clone()
    flipped[-3] ^= 0x40  # one bit of tensor data
    with pytest.raises(TransportError, match="corrupted in transit"):
        decode_adapter(flipped)
    with pytest.raises(TransportError, match="malformed"):
        decode_adapter(buffer[: buffer.numel() // 2])
    bad = buffer.clone()
    bad[:8] = torch.tensor(list((1 << 40).to_bytes(8, "little")), dtype=torch.uint8)
    with pytest.raises(TransportError, match="header length"):
        decode_adapter(bad)


def test_errors_and_results_survive_json():
    err = EngineUnavailableError("engine down; retry later", engine="vllm", url="http://127.0.0.1:8000", attempts=3, opaque=object())
    data = json.loads(json.dumps(encode_error(err)))
    back = decode_error(data, node="b")
    assert type(back) is EngineUnavailableError and str(back) == str(err)
    assert (back.engine, back.url, back.attempts, back.node) == ("vllm", "http://127.0.0.1:8000", 3, "b")
    assert not hasattr(back, "opaque")  # not JSON: dropped, never pickled
    # only lorasync error classes are rebuilt by name
    assert type(decode_error({"type": "SystemExit", "message": "x"})) is PublishError
    assert type(decode_error({"type": "ShapeMismatchError", "message": "x"})) is ShapeMismatchError

    result = EngineResult(
        engine="vllm", url="http://127.0.0.1:8000", status="failed", transport="disk", reason="r",
        served_name=None, bytes_moved=12, timings={"load": 0.5}, retired=["p@v1"], error=err,
    )
    again = decode_result(json.loads(json.dumps(encode_result(result))))
    assert again.to_dict() == result.to_dict()


def role(rank, node, leader=None, engines=0, name="policy", src=0, problem=None):
    return {"rank": rank, "node": node, "leader": leader, "engines": engines, "name": name, "src": src, "problem": problem}


def test_resolve_leaders_and_members():
    roles = [role(0, "a", True, 1), role(1, "a", False), role(2, "b"), role(3, "b", None, 0), role(4, "c", None, 2)]
    leaders, members = _resolve(roles, 0)
    assert leaders == {"a": 0, "b": 2, "c": 4}
    assert members == [0, 4]  # node b has no engines: it receives nothing
    assert _resolve(roles, 3)[1] == [0, 3, 4]


@pytest.mark.parametrize(
    "roles,src,message",
    [
        ([role(0, "a", True, 1), role(1, "a", True)], 0, "several leaders"),
        ([role(0, "a", False, 0), role(1, "a", False)], 0, "has no leader"),
        ([role(0, "a", True, 1), role(1, "a", False, 1)], 0, "holds engines but rank 0 leads"),
        ([role(0, "a", True), role(1, "b", True)], 0, "no rank holds engines"),
        ([role(0, "a", True, 1), role(1, "b", True, 1)], 5, "src=5 is not a rank"),
        ([role(0, "a", True, 1), role(1, "b", True, 1, name="other")], 0, "different names"),
        ([role(0, "a", True, 1), role(1, "b", True, 1, src=1)], 0, "different src"),
    ],
)
def test_resolve_refuses_bad_layouts(roles, src, message):
    with pytest.raises(ConfigError, match=message):
        _resolve(roles, src)


def test_a_local_problem_is_raised_everywhere_as_itself():
    problem = encode_error(InvalidNameError("adapter name '../x' may use only ASCII letters"))
    with pytest.raises(InvalidNameError, match="ASCII") as info:
        _resolve([role(0, "a", True, 1), role(1, "b", True, 1, problem=problem)], 0)
    assert info.value.rank == 1


def test_needs_an_initialised_process_group():
    with pytest.raises(ConfigError, match="init_process_group"):
        DistributedPublisher(name="policy")
