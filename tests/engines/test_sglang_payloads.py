"""SGLang client requests for server versions the test peer does not run (0.5.4-0.5.17), and the
pure helpers. Operations are sans-IO generators, so they are stepped here with the answers a
server of that version gives; no server is involved."""

from __future__ import annotations

import pickletools
from collections.abc import Generator
from typing import Any

import httpx
import pytest
import torch

from lorasync import Adapter, AdapterConfig
from lorasync.adapter._keys import peft_key
from lorasync.engines._http import Call
from lorasync.engines.sglang import SGLangEngine, pad_ranks, served_leaves
from lorasync.errors import (
    AdapterNotFoundError,
    AdapterRejectedError,
    CapabilityError,
    CapacityError,
    ConfigError,
    EngineError,
    IncompatibleAdapterError,
    LoraNotEnabledError,
)

INFO = {
    "enable_lora": True,
    "max_lora_rank": 16,
    "lora_target_modules": ["q_proj", "v_proj", "gate_proj"],
    "max_loaded_loras": None,
    "max_loras_per_batch": 8,
    "tp_size": 2,
    "dp_size": 1,
    "tokenizer_worker_num": 1,
}
OK_LORA = {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "", "loaded_adapters": {}}


def _adapter(modules: tuple[str, ...] = ("q_proj", "v_proj"), r: int = 4, **config: Any) -> Adapter:
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(2):
        for leaf in modules:
            module = f"model.layers.{layer}.self_attn.{leaf}"
            rank = config.get("rank_pattern", {}).get(module, r)
            tensors[peft_key(module, "A")] = torch.randn(rank, 256, generator=gen)
            tensors[peft_key(module, "B")] = torch.randn(64, rank, generator=gen)
    return Adapter(tensors, AdapterConfig(r=r, lora_alpha=config.pop("lora_alpha", 2 * r), **config))


def _drive(op: Generator[Call, httpx.Response, Any], answers: dict[str, Any]) -> list[Call]:
    """Run ``op``, answering each call from ``answers`` (path -> JSON body), and return the calls."""
    calls = []
    try:
        call = next(op)
        while True:
            calls.append(call)
            call = op.send(httpx.Response(200, json=answers[call.path]))
    except StopIteration:
        return calls


def test_0_5_10_sends_one_serialized_tensors_string() -> None:
    engine = SGLangEngine("http://sglang:30000", version="0.5.10")
    calls = _drive(engine._load_tensors_op("a", _adapter(), False), {"/server_info": INFO, "/load_lora_adapter_from_tensors": OK_LORA})
    body = calls[-1].json
    assert sorted(body) == ["config_dict", "lora_name", "serialized_tensors"]
    assert isinstance(body["serialized_tensors"], str)


@pytest.mark.parametrize(("version", "field", "checksums"), [("0.5.15", "serialized_tensors", False), ("0.5.16", "serialized_tensors", True)])
def test_checksums_go_from_0_5_16_the_release_that_reads_them(version: str, field: str, checksums: bool) -> None:
    """0.5.16 added expected_checksums to the one-string route; 0.5.15 has no such field (read in
    the wheels), and SGLang drops an unknown field unread: sending it there would check nothing."""
    from lorasync.engines.sglang.protocol import sha256

    adapter = _adapter()
    engine = SGLangEngine("http://sglang:30000", version=version)
    body = _drive(engine._load_tensors_op("a", adapter, False), {"/server_info": INFO, "/load_lora_adapter_from_tensors": OK_LORA})[-1].json
    assert sorted(body) == sorted(["config_dict", "lora_name", field] + (["expected_checksums"] if checksums else []))
    if checksums:
        assert body["expected_checksums"] == {k: sha256(t) for k, t in adapter.tensors.items()}
    off = SGLangEngine("http://sglang:30000", version=version, checksums=False)
    assert "expected_checksums" not in _drive(off._load_tensors_op("a", adapter, False), {"/server_info": INFO, "/load_lora_adapter_from_tensors": OK_LORA})[-1].json


def test_0_5_17_sends_one_payload_per_tp_rank_with_checksums() -> None:
    engine = SGLangEngine("http://sglang:30000", version="0.5.17")
    calls = _drive(engine._load_tensors_op("a", _adapter(), True), {"/server_info": INFO, "/load_lora_adapter_from_tensors": OK_LORA})
    body = calls[-1].json
    assert sorted(body) == ["config_dict", "expected_checksums", "lora_name", "pinned", "serialized_named_tensors"]
    first, second = body["serialized_named_tensors"]  # tp_size 2 in server_info
    assert first == second


def test_0_5_4_has_no_tensor_route() -> None:
    engine = SGLangEngine("http://sglang:30000", version="0.5.4")
    op = engine._load_tensors_op("a", _adapter(), False)
    assert next(op).path == "/server_info"
    with pytest.raises(CapabilityError, match="0.5.10"):
        op.send(httpx.Response(200, json=INFO))


def test_before_0_5_23_weight_updates_have_no_session() -> None:
    engine = SGLangEngine("http://sglang:30000", version="0.5.17", tp_size=1)
    ok = {"success": True, "message": "Success"}
    calls = _drive(engine._update_weights_op({"lm_head.weight": torch.ones(4, 4)}), {"/update_weights_from_tensor": ok})
    assert [c.path for c in calls] == ["/update_weights_from_tensor"]
    assert calls[0].json["flush_cache"] is True and len(calls[0].json["serialized_named_tensors"]) == 1


def test_get_server_info_is_the_fallback_of_old_servers() -> None:
    engine = SGLangEngine("http://sglang:30000")
    op = engine._capabilities_op()
    assert next(op).path == "/server_info"
    assert op.send(httpx.Response(404, json={"detail": "Not Found"})).path == "/get_server_info"
    assert op.send(httpx.Response(200, json=INFO)).path == "/openapi.json"  # 0.5.23+: the routes decide
    with pytest.raises(StopIteration) as done:
        op.send(httpx.Response(200, json={"paths": {"/load_lora_adapter_from_tensors": {}}}))
    caps = done.value.value
    assert caps.max_rank == 16 and caps.target_modules == {"q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj"}


def test_payload_uses_only_globals_sglang_allows() -> None:
    # SGLang's SafeUnpickler allowlist (sglang/srt/utils/common.py) admits these for plain pickles
    # of CPU tensors; ForkingPickler's fd-sharing globals would need the same host.
    import base64

    engine = SGLangEngine("http://sglang:30000", version="0.5.17")
    calls = _drive(engine._load_tensors_op("a", _adapter().to(dtype=torch.bfloat16), False), {"/server_info": INFO, "/load_lora_adapter_from_tensors": OK_LORA})
    data = base64.b64decode(calls[-1].json["serialized_named_tensors"][0])
    strings: list[str] = []
    found = set()
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif opcode.name == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
        elif opcode.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
    assert found <= {
        ("collections", "OrderedDict"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch.storage", "_load_from_bytes"),
    }


def test_served_leaves_follow_sglang_packing() -> None:
    assert served_leaves(None) is None and served_leaves(["all"]) is None and served_leaves("all-linear") is None
    assert served_leaves(["k_proj", "o_proj"]) == {"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj"}


def test_pad_ranks_is_exact_and_uniform() -> None:
    pattern = {"model.layers.0.self_attn.q_proj": 2, "model.layers.1.self_attn.v_proj": 2}
    adapter = _adapter(r=4, rank_pattern=pattern, alpha_pattern={m: 4.0 for m in pattern}, lora_alpha=8)
    assert adapter.engine_safe_scaling
    padded = pad_ranks(adapter)
    assert padded.config.r == 4 and not padded.config.rank_pattern
    assert {padded.pair(m)[0].shape[0] for m in padded.modules} == {4}
    for module in adapter.modules:
        torch.testing.assert_close(padded.delta(module), adapter.delta(module), rtol=0, atol=0)
    assert pad_ranks(padded) is padded


@pytest.mark.parametrize(
    ("modules", "missing"),
    [(("q_proj",), "v_proj"), (("k_proj", "v_proj"), "q_proj"), (("up_proj",), "gate_proj")],
)
def test_shapes_sglang_cannot_pack_are_refused(modules: tuple[str, ...], missing: str) -> None:
    engine = SGLangEngine("http://sglang:30000")
    info = {**INFO, "lora_target_modules": ["all"]}
    op = engine._preflight_op(_adapter(modules))
    next(op)
    with pytest.raises(IncompatibleAdapterError, match=missing):
        op.send(httpx.Response(200, json=info))


def test_dp_above_one_cannot_load_at_runtime() -> None:
    engine = SGLangEngine("http://sglang:30000")
    op = engine._preflight_op(_adapter())
    next(op)
    with pytest.raises(CapabilityError, match="--dp-size 1"):
        op.send(httpx.Response(200, json={**INFO, "dp_size": 2}))


@pytest.mark.parametrize("bad", [{"version": "latest"}, {"tp_size": 0}, {"weight_bucket_bytes": 0}])
def test_bad_options(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        SGLangEngine("http://sglang:30000", **bad)


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (400, {**OK_LORA, "success": False, "error_message": "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."}, LoraNotEnabledError),
        (400, {**OK_LORA, "success": False, "error_message": "Failed to load a because LoRA serving currently doesn't support DoRA adapters"}, IncompatibleAdapterError),
        (400, {**OK_LORA, "success": False, "error_message": "Failed to load LoRA adapter a as a pinned adapter. It is not allowed to pin all slots in the LoRA memory pool"}, CapacityError),
        (400, {**OK_LORA, "success": False, "error_message": "[Errno 2] No such file or directory: '/x/adapter_config.json'"}, AdapterNotFoundError),
        (400, {**OK_LORA, "success": False, "error_message": "'peft_type'"}, AdapterRejectedError),
        (500, "Internal Server Error", EngineError),
        (404, {"detail": "Not Found"}, CapabilityError),
    ],
)
def test_texts_of_other_server_setups_map_to_typed_errors(status: int, body: Any, error: type) -> None:
    # Refusals the test peer's configuration cannot produce (LoRA off, DoRA, pinning, dp > 1),
    # with SGLang 0.5.23's exact texts (see the engine contract, section 1.2).
    engine = SGLangEngine("http://sglang:30000")
    op = engine._load_op("a", "/x", False)
    next(op)
    answer = httpx.Response(status, json=body) if isinstance(body, dict) else httpx.Response(status, text=body)
    with pytest.raises(error) as info:
        op.send(answer)
    assert type(info.value) is error and info.value.status == status


def test_mixed_ranks_are_refused_for_disk_and_padded_for_tensors() -> None:
    pattern = {"model.layers.0.self_attn.q_proj": 2}
    adapter = _adapter(r=4, rank_pattern=pattern, alpha_pattern={m: 4.0 for m in pattern}, lora_alpha=8)
    engine = SGLangEngine("http://sglang:30000", version="0.5.23")
    op = engine._preflight_op(adapter)
    next(op)
    with pytest.raises(IncompatibleAdapterError, match="pad_ranks"):
        op.send(httpx.Response(200, json=INFO))
    answers = {"/server_info": INFO, "/openapi.json": {"paths": {"/load_lora_adapter_from_tensors": {}}}, "/load_lora_adapter_from_tensors": OK_LORA}
    calls = _drive(engine._load_tensors_op("a", adapter, False), answers)
    assert calls[-1].json["config_dict"]["r"] == 4 and calls[-1].json["config_dict"]["lora_alpha"] == 8
