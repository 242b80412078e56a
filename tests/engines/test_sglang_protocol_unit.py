"""How the SGLang client picks its tensor protocol, and what a streamed load sends when things
fail, stepped with recorded answers (no server: tests/engines/test_sglang_protocols.py runs both
protocols against SGLang's own app)."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import httpx
import pytest
import torch

from lorasync import Adapter, AdapterConfig
from lorasync.adapter._keys import peft_key
from lorasync.engines._http import Call
from lorasync.engines.sglang import SGLangEngine
from lorasync.errors import AdapterRejectedError, CapabilityError, CapacityError, EngineError

INFO = {"enable_lora": True, "max_lora_rank": 16, "lora_target_modules": ["q_proj", "v_proj"], "tp_size": 1, "dp_size": 1, "version": "0.5.23"}
OK_LORA = {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "", "loaded_adapters": {}}
OK = {"success": True, "message": "Success"}


def _adapter() -> Adapter:
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for leaf in ("q_proj", "v_proj"):
        module = f"model.layers.0.self_attn.{leaf}"
        tensors[peft_key(module, "A")] = torch.randn(4, 64, generator=gen)
        tensors[peft_key(module, "B")] = torch.randn(64, 4, generator=gen)
    return Adapter(tensors, AdapterConfig(r=4, lora_alpha=8))


Answer = Callable[[Call], httpx.Response]


def _drive(op: Generator[Call, httpx.Response, Any], answer: Answer) -> list[Call]:
    calls: list[Call] = []
    call = next(op)
    try:
        while True:
            calls.append(call)
            call = op.send(answer(call))
    except StopIteration:
        return calls


def _server(routes: dict[str, Any], *, models: list[str] | None = None) -> Answer:
    listed = list(models or [])

    def answer(call: Call) -> httpx.Response:
        if call.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": n, "parent": "base", "root": "__stream__"} for n in listed]})
        reply = routes.get(call.path, (404, {"detail": "Not Found"}))
        if callable(reply):
            reply = reply(call)
        status, body = reply if isinstance(reply, tuple) else (200, reply)
        if call.path == "/end_weight_update" and status == 200 and body.get("success") and call.json is not None:
            listed.append("pol@v1")
        return httpx.Response(status, json=body)

    return answer


STREAMED_ROUTES = {"/server_info": INFO, "/openapi.json": {"paths": {"/register_lora_adapter": {}, "/update_weights_from_tensor": {}}},
                   "/register_lora_adapter": OK_LORA, "/begin_weight_update": OK, "/update_weights_from_tensor": OK,
                   "/end_weight_update": OK, "/unload_lora_adapter": OK_LORA}  # fmt: skip


def test_routes_not_the_version_pick_the_streamed_protocol() -> None:
    engine = SGLangEngine("http://sglang:30000", version="auto")
    calls = _drive(engine._load_tensors_op("pol@v1", _adapter(), False), _server(STREAMED_ROUTES))
    paths = [c.path for c in calls]
    assert paths == ["/server_info", "/openapi.json", "/v1/models", "/register_lora_adapter",
                     "/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update", "/v1/models"]  # fmt: skip
    register, update = calls[3].json, calls[5].json
    assert sorted(register) == ["config_dict", "lora_name"] and register["lora_name"] == "pol@v1"
    assert update["flush_cache"] is False and len(update["serialized_named_tensors"]) == 1
    assert not calls[4].retry and not calls[6].retry  # sessions are never repeated blindly


def test_without_openapi_a_get_on_each_route_decides() -> None:
    """DISABLE_OPENAPI_DOC: a GET on a POST route answers 405 where it exists."""
    engine = SGLangEngine("http://sglang:30000")
    routes = {"/server_info": INFO, "/register_lora_adapter": (405, {"detail": "Method Not Allowed"})}
    calls = _drive(engine._capabilities_op(), _server(routes))
    assert [(c.method, c.path) for c in calls] == [("GET", "/server_info"), ("GET", "/openapi.json"), ("GET", "/register_lora_adapter")]
    engine2 = SGLangEngine("http://sglang:30000")
    routes2 = {"/server_info": INFO, "/load_lora_adapter_from_tensors": (405, {"detail": "Method Not Allowed"})}
    _drive(engine2._capabilities_op(), _server(routes2))
    assert engine2._protocol == "tensors"
    caps = _drive_value(SGLangEngine("http://sglang:30000")._capabilities_op(), _server({"/server_info": INFO}))
    assert not caps.tensor_load and any("no route" in n for n in caps.notes)


def _drive_value(op: Generator[Call, httpx.Response, Any], answer: Answer) -> Any:
    call = next(op)
    try:
        while True:
            call = op.send(answer(call))
    except StopIteration as stop:
        return stop.value


def test_older_servers_follow_the_version_table_without_asking() -> None:
    engine = SGLangEngine("http://sglang:30000", version="0.5.17")
    calls = _drive(engine._capabilities_op(), _server({"/server_info": {**INFO, "version": "0.5.17"}}))
    assert [c.path for c in calls] == ["/server_info"] and engine._protocol == "tensors"


def test_no_tensor_route_is_a_capability_error_before_any_load() -> None:
    engine = SGLangEngine("http://sglang:30000")
    answer = _server({"/server_info": INFO, "/openapi.json": {"paths": {"/load_lora_adapter": {}}}})
    with pytest.raises(CapabilityError, match="disk transport"):
        _drive(engine._load_tensors_op("pol@v1", _adapter(), False), answer)


@pytest.mark.parametrize("fail", ["/update_weights_from_tensor", "/end_weight_update", "/begin_weight_update"])
def test_a_failed_stream_unregisters_before_it_closes_the_session(fail: str) -> None:
    """Wherever the stream fails, the name is unloaded first (so the session's stash, applied at
    its end, belongs to no served name), then an open session is closed."""
    engine = SGLangEngine("http://sglang:30000")
    seen: list[Call] = []
    refusal = {"success": False, "message": "[LORA-CHECK] adapter 'pol@v1': checksum mismatch"}
    routes = {**STREAMED_ROUTES, fail: (400, refusal)}

    def answer(call: Call) -> httpx.Response:
        seen.append(call)
        return _server(routes)(call)

    with pytest.raises(EngineError) as info:
        _drive(engine._load_tensors_op("pol@v1", _adapter(), False), answer)
    after = [c.path for c in seen[[c.path for c in seen].index(fail) + 1 :]]
    if fail == "/update_weights_from_tensor":
        assert after == ["/unload_lora_adapter", "/end_weight_update"]
        assert isinstance(info.value, AdapterRejectedError)
    else:
        assert after == ["/unload_lora_adapter"]  # no session left open to close
    assert engine._streaming == {}


def test_an_unload_that_fails_too_is_reported_with_the_name() -> None:
    engine = SGLangEngine("http://sglang:30000", retries=1)
    routes = {**STREAMED_ROUTES, "/update_weights_from_tensor": (400, {"success": False, "message": "boom"}),
              "/unload_lora_adapter": (500, {"detail": "down"})}  # fmt: skip
    with pytest.raises(EngineError, match=r"could not unregister 'pol@v1'.*unload_adapter\('pol@v1'\)"):
        _drive(engine._load_tensors_op("pol@v1", _adapter(), False), _server(routes))


def test_a_new_name_at_the_cap_is_a_capacity_error() -> None:
    engine = SGLangEngine("http://sglang:30000")
    refused = {**OK_LORA, "success": False, "error_message": "4 adapters are loaded and --max-loaded-loras is 4"}
    routes = {**STREAMED_ROUTES, "/register_lora_adapter": (400, refused)}
    with pytest.raises(CapacityError, match="max-loaded-loras"):
        _drive(engine._load_tensors_op("pol@v1", _adapter(), False), _server(routes))
