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


# -- found by the outside attack on the router change (each was a failing repro) ------------------


def test_errors_about_listed_workers_never_show_their_credentials() -> None:
    secret, token = "s3cr3t-worker-pass", "tok-9f8e7d"
    listed = [f"http://admin:{secret}@10.0.0.5:8000", f"http://10.0.0.6:8000/?api_key={token}"]
    with pytest.raises(ReplicatedEngineError) as refused:
        VLLMEngine("http://router:30000", transport=answering({"urls": listed})).capabilities()
    with pytest.raises(EngineProtocolError) as odd:
        VLLMRouter("http://router:30000", transport=answering({"urls": [f"ftp://admin:{secret}@10.0.0.5:21"]})).members()
    for caught in (refused, odd):
        text = str(caught.value) + repr(caught.value) + repr(vars(caught.value))
        assert secret not in text and token not in text, text
    assert "http://10.0.0.5:8000" in str(refused.value)  # where the servers are, still said


def test_one_server_listed_under_two_spellings_is_one_engine() -> None:
    listed = ["http://127.0.0.1:8101", "http://localhost:8101/", "http://127.0.0.1:8102"]
    group = VLLMRouter("http://router:30000", transport=answering({"urls": listed}))
    assert [e.url for e in group.members()] == ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    pub = Publisher(group, name="p")  # not refused as the same engine given twice
    pub.close()


@pytest.mark.parametrize("failure", [httpx.ReadTimeout, httpx.RemoteProtocolError])
def test_a_worker_list_route_that_fails_is_not_a_router(failure: type[Exception]) -> None:
    """A proxy in front of one vLLM that times out or resets on /list_workers: the probe goes on."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/list_workers":
            raise failure("held by the proxy", request=request)  # type: ignore[call-arg]
        if request.url.path == "/v1/load_lora_adapter":
            return httpx.Response(405, json={"detail": "Method Not Allowed"})
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        return httpx.Response(404, json={"detail": "Not Found"})

    with VLLMEngine("http://one-vllm:8000", transport=httpx.MockTransport(handle), retries=0) as engine:
        assert engine.capabilities().runtime_lora


def test_pull_mode_takes_a_router_url(tmp_path: Any) -> None:
    """Pull mode is made for replicas behind one URL (each loads from the shared folder)."""
    from lorasync.engines.vllm.pull import VLLMPullEngine

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/list_workers":
            return httpx.Response(200, json={"urls": WORKERS})
        if request.url.path == "/v1/load_lora_adapter":
            return httpx.Response(405, json={"detail": "Method Not Allowed"})
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        return httpx.Response(404, json={"detail": "Not Found"})

    with VLLMPullEngine("http://router:30000", pull_dir=tmp_path, transport=httpx.MockTransport(handle), retries=0) as engine:
        assert engine.capabilities().runtime_lora
    with VLLMEngine("http://router:30000", transport=httpx.MockTransport(handle), retries=0) as engine, pytest.raises(ReplicatedEngineError):
        engine.capabilities()


def test_the_function_api_closes_each_worker_it_made(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import asyncio

    from lorasync import apublish_adapter, publish_adapter
    from lorasync.testing import tiny_llama_adapter

    def down(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"urls": WORKERS}) if request.url.path == "/list_workers" else httpx.Response(503, json={"detail": "down"})

    async def adown(request: httpx.Request) -> httpx.Response:
        return down(request)

    made_here = VLLMRouter.__init__
    monkeypatch.setattr(VLLMRouter, "__init__", lambda self, url, **o: made_here(self, url, transport=httpx.MockTransport(down), async_transport=httpx.MockTransport(adown), retries=0, **o))
    closed: dict[str, list[str]] = {"close": [], "aclose": []}
    real_close, real_aclose = VLLMEngine.close, VLLMEngine.aclose

    def close(self: VLLMEngine) -> None:
        closed["close"].append(self.url)
        real_close(self)

    async def aclose(self: VLLMEngine) -> None:
        closed["aclose"].append(self.url)
        await real_aclose(self)

    monkeypatch.setattr(VLLMEngine, "close", close)
    monkeypatch.setattr(VLLMEngine, "aclose", aclose)
    mine = VLLMEngine("http://127.0.0.1:8200", transport=httpx.MockTransport(down), async_transport=httpx.MockTransport(adown), retries=0)
    specs = ["vllm-router:http://router:30000", mine]
    report = publish_adapter(tiny_llama_adapter(), specs, name="p", version=1, root=tmp_path)
    assert not report.ok and sorted(r.url for r in report.results) == sorted([*WORKERS, mine.url])
    # The sync call lets go of every engine's connections on its own loop before that loop stops
    # (an HTTP client's connections open again at its next call); the workers it made are closed.
    assert set(WORKERS) <= set(closed["close"])
    closed["close"].clear()
    asyncio.run(apublish_adapter(tiny_llama_adapter(), specs, name="p", version=2, root=tmp_path))
    assert set(WORKERS) <= set(closed["aclose"])  # each worker client it made from the spec (the attack: only the first)
    # A group object (not a spec) works there too.
    asyncio.run(apublish_adapter(tiny_llama_adapter(), VLLMRouter("http://router:30000"), name="p", version=3, root=tmp_path))


def test_the_distributed_classes_take_a_group_object(tmp_path: Any) -> None:
    import torch.distributed as dist

    from lorasync.distributed import DistributedFleet, DistributedPublisher

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        for cls, options in ((DistributedPublisher, {"name": "policy"}), (DistributedFleet, {})):
            made = cls(engines=VLLMRouter("http://router:30000", transport=answering({"urls": WORKERS})), **options)
            try:
                local = made._local if cls is DistributedPublisher else made.local
                assert sorted(e.url for e in local.engines) == WORKERS
            finally:
                made.close()
    finally:
        dist.destroy_process_group()


def test_the_demo_names_an_unreachable_router(dead_url: str) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "lorasync", "demo", "--engine", f"vllm-router:{dead_url}", "--steps", "1"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "cannot reach vllm-router" in done.stderr
