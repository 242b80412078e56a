"""The router group's answers to what a router can say (tests/engines/test_vllm_router.py runs the
real vllm-router over real vLLM servers): every publisher surface takes its workers as engines,
and each wrong answer is a typed error that says what to do."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from lorasync import Fleet, Publisher
from lorasync.engines import EngineGroup, connect
from lorasync.engines._registry import engine_list
from lorasync.engines.vllm import VLLMEngine
from lorasync.engines.vllm.router import VLLMRouter
from lorasync.errors import CapabilityError, ConfigError, EngineProtocolError, ReplicatedEngineError

WORKERS = ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]


def answering(body: Any, status: int = 200, seen: list[str] | None = None) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(f"{request.method} {request.url.path}")
        if request.url.path == "/list_workers":
            return httpx.Response(status, content=body if isinstance(body, bytes) else json.dumps(body).encode())
        return httpx.Response(404, json={"detail": "Not Found"})

    return httpx.MockTransport(handle)


def test_a_router_spec_is_its_workers_each_an_engine_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[str] = []
    monkeypatch.setattr(VLLMRouter, "close", lambda self: closed.append(self.url))
    group = connect("vllm-router", "http://router:30000", transport=answering({"urls": WORKERS[::-1]}))
    assert isinstance(group, EngineGroup)
    made: list[Any] = []
    engines = engine_list([group], what="publish", made=made)
    assert [type(e) for e in engines] == [VLLMEngine, VLLMEngine]
    assert [e.url for e in engines] == WORKERS and made == engines  # the caller's to close
    assert closed == []  # the group is the caller's own: left open


def test_the_publisher_publishes_to_each_worker_and_closes_what_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    made_here = VLLMRouter.__init__
    monkeypatch.setattr(VLLMRouter, "__init__", lambda self, url, **o: made_here(self, url, transport=answering({"urls": WORKERS}), **o))
    pub = Publisher(["vllm-router:http://router:30000"], name="p")
    try:
        assert [e.url for e in pub.engines] == WORKERS
        assert [e.url for e in pub._made] == WORKERS
    finally:
        pub.close()


@pytest.mark.parametrize(
    ("body", "status", "error", "says"),
    [
        ({"detail": "Not Found"}, 404, CapabilityError, "not a vllm-router"),
        ({"urls": []}, 200, CapabilityError, "has no workers"),
        ({"urls": ["file:///etc/passwd"]}, 200, EngineProtocolError, "not an http"),
        (b"<html>gateway</html>", 200, EngineProtocolError, "not a list of worker URLs"),
    ],
)
def test_what_a_router_cannot_be_published_through_says_why(body: Any, status: int, error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=says):
        VLLMRouter("http://router:30000", transport=answering(body, status)).members()


def test_a_fleet_takes_the_workers_and_refuses_to_add_a_group_as_one_engine() -> None:
    group = VLLMRouter("http://router:30000", transport=answering({"urls": WORKERS}))
    fleet = Fleet(group)
    try:
        assert [e.url for e in fleet.engines] == WORKERS
        with pytest.raises(ConfigError, match="add them one by one"):
            fleet.add_engine(VLLMRouter("http://other:30000", transport=answering({"urls": ["http://127.0.0.1:8103"]})))
    finally:
        fleet.close()


def test_the_plain_client_names_the_router_kind_instead_of_loading_into_one_worker() -> None:
    seen: list[str] = []
    engine = VLLMEngine("http://router:30000", transport=answering({"urls": WORKERS}, seen=seen))
    with pytest.raises(ReplicatedEngineError, match="vllm-router:http://router:30000") as caught:
        engine.capabilities()
    assert "2 server(s)" in str(caught.value)
    assert not [call for call in seen if call.startswith("POST")], seen  # nothing was loaded anywhere
