"""VLLMEngine without a server: body parsing vLLM's real server cannot produce on demand
(empty 200s, the pre-0.10.1 flat error envelope) and the retry behaviour.

Everything a real vLLM 0.32 server can answer is tested against one in test_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest

from lorasync import RetryPolicy
from lorasync.engines import parse_engine_spec
from lorasync.engines.vllm import VLLMEngine
from lorasync.errors import (
    AdapterAlreadyLoadedError,
    AdapterNotFoundError,
    EngineProtocolError,
    EngineUnavailableError,
    RankTooLargeError,
)

FAST = RetryPolicy(attempts=3, backoff=0.0, jitter=0.0)
Handler = Callable[[httpx.Request], httpx.Response]


def mock_engine(handler: Handler, *, retries: RetryPolicy = FAST) -> VLLMEngine:
    transport = httpx.MockTransport(handler)  # serves both the sync and the async client
    return VLLMEngine("http://vllm.test:8000", retries=retries, transport=transport, async_transport=transport)


def test_spec_string_connects_a_vllm_client() -> None:
    engine = parse_engine_spec("vllm:http://127.0.0.1:8123")
    assert isinstance(engine, VLLMEngine) and engine.url == "http://127.0.0.1:8123"


# -- parsing -------------------------------------------------------------------------------------------


def test_empty_200_is_success_once_models_confirms_sync_and_async() -> None:
    # vLLM answers "Success: ..." text; an empty 200 (a proxy, another server) counts only when
    # /v1/models confirms the adapter (tests/reliability covers the unconfirmed case).
    seen: list[tuple[str, str]] = []
    loaded: dict[str, str] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            cards = [{"id": n, "root": p, "parent": "base"} for n, p in loaded.items()]
            return httpx.Response(200, json={"data": [{"id": "base", "parent": None}, *cards]})
        seen.append((request.url.path, request.headers["content-type"]))
        body = json.loads(request.content)
        if request.url.path.endswith("/load_lora_adapter"):
            loaded[body["lora_name"]] = body["lora_path"]
        else:
            loaded.pop(body["lora_name"], None)
        return httpx.Response(200)  # no body, no content type

    engine = mock_engine(handler)
    assert engine.load_adapter("p@v1", "/dev/shm/p/v1") is None
    assert engine.unload_adapter("p@v1") is None

    async def twins() -> None:
        await engine.aload_adapter("p@v2", "/dev/shm/p/v2")
        await engine.aunload_adapter("p@v2")

    asyncio.run(twins())
    assert [path for path, _ in seen] == ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"] * 2
    assert {ctype for _, ctype in seen} == {"application/json"}  # vLLM refuses anything else
    assert loaded == {}


def test_empty_200_where_json_is_needed_is_a_protocol_error() -> None:
    engine = mock_engine(lambda request: httpx.Response(200))
    with pytest.raises(EngineProtocolError, match="/v1/models"):
        engine.list_adapters()
    with pytest.raises(EngineProtocolError, match="/v1/completions"):
        engine.generate([1, 2], model="p@v1")


@pytest.mark.parametrize(
    ("status", "message", "cls"),
    [
        (400, "The lora adapter 'p@v1' has already been loaded.", AdapterAlreadyLoadedError),
        (404, "Loading lora p@v1 failed: No adapter found for /dev/shm/p/v1", AdapterNotFoundError),
        (400, "LoRA rank 64 is greater than max_lora_rank 16.", RankTooLargeError),
    ],
)
def test_flat_error_envelope_of_older_vllm(status: int, message: str, cls: type[Exception]) -> None:
    # Before v0.10.1 errors were {"object": "error", "message": ..., "type": ..., "code": ...}.
    body = {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status}
    engine = mock_engine(lambda request: httpx.Response(status, json=body))
    with pytest.raises(cls) as info:
        engine.load_adapter("p@v1", "/dev/shm/p/v1")
    assert (info.value.status, info.value.adapter) == (status, "p@v1")


# -- retries -------------------------------------------------------------------------------------------


def test_connection_refused_is_retried_then_named(dead_url: str) -> None:
    url = dead_url  # nothing listens there
    engine = VLLMEngine(url, retries=FAST)
    with pytest.raises(EngineUnavailableError) as info:
        engine.load_adapter("policy@v7", "/dev/shm/p/v7")
    err = info.value
    assert (err.engine, err.adapter, err.attempts, err.url) == ("vllm", "policy@v7", 3, f"{url}/v1/load_lora_adapter")
    for part in ("vllm", f"{url}/v1/load_lora_adapter", "'policy@v7'", "after 3 attempts"):
        assert part in str(err)

    async def twin() -> None:
        with pytest.raises(EngineUnavailableError) as ainfo:
            await engine.aload_adapter("policy@v7", "/dev/shm/p/v7")
        assert ainfo.value.attempts == 3

    asyncio.run(twin())


def test_503_is_retried_until_it_passes() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(503, json={"error": "busy"}) if len(calls) < 3 else httpx.Response(200, text="Success")

    engine = mock_engine(handler)
    engine.load_adapter("p@v1", "/dev/shm/p/v1")
    assert len(calls) == 3


def test_503_until_retries_run_out() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(503, text="overloaded")

    engine = mock_engine(handler, retries=RetryPolicy(attempts=4, backoff=0.0, jitter=0.0))
    with pytest.raises(EngineUnavailableError) as info:
        engine.unload_adapter("p@v1")
    assert (len(calls), info.value.attempts, info.value.status) == (4, 4, 503)
    assert "HTTP 503 after 4 attempts" in str(info.value)


def test_400_is_never_retried_sync_and_async() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        message = "The lora adapter 'p@v1' has already been loaded. If you want to load the adapter in place, ..."
        return httpx.Response(400, json={"error": {"message": message, "type": "InvalidUserInput", "code": 400}})

    engine = mock_engine(handler)
    with pytest.raises(AdapterAlreadyLoadedError) as info:
        engine.load_adapter("p@v1", "/dev/shm/p/v1")
    assert (len(calls), info.value.attempts) == (1, 1)
    with pytest.raises(AdapterAlreadyLoadedError):
        asyncio.run(engine.aload_adapter("p@v1", "/dev/shm/p/v1"))
    assert len(calls) == 2


def test_adapters_in_use_without_the_lora_gauge_is_unknown() -> None:
    # A server without --enable-lora publishes no vllm:lora_requests_info; one behind a proxy
    # that hides /metrics answers 404. Neither can tell: None, so retirement falls back to a grace period.
    metrics = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
    for status, text in ((200, metrics), (404, "")):
        engine = mock_engine(lambda request, status=status, text=text: httpx.Response(status, text=text))
        assert engine.adapters_in_use() is None
        assert asyncio.run(engine.aadapters_in_use()) is None


# -- a dead engine core ------------------------------------------------------------------------------

DEAD = {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.", "type": "InternalServerError", "param": None, "code": 500}}


def test_a_dead_engine_core_is_reported_as_such_through_the_publisher(tmp_path) -> None:
    from lorasync import Publisher
    from lorasync.errors import EngineDeadError
    from lorasync.testing import tiny_llama_adapter

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "base", "object": "model", "parent": None}]})
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        return httpx.Response(500, json=DEAD)  # what vLLM 0.32 answers once its engine core died

    engine = mock_engine(handler)
    with pytest.raises(EngineDeadError, match="restart the server"):
        engine.load_adapter("p@v1", str(tmp_path))
    report = Publisher([engine], name="p", root=tmp_path / "store", transport="disk").publish(tiny_llama_adapter(), version=1)
    error = report.results[0].error
    assert isinstance(error, EngineDeadError) and isinstance(error, EngineUnavailableError)
    assert "engine core died" in str(error) and "next publish" in str(error)
