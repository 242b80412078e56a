"""Both SGLang tensor protocols against SGLang's own HTTP app (the contract peer), one suite.

``tensors``: SGLang 0.5.23 as released (``/load_lora_adapter_from_tensors``). ``streamed``: the
same app serving SGLang main's streamed adapters (PR #36384: ``/register_lora_adapter`` and
``"{name}:{key}"`` tensors through a weight-update session), built from the facts recorded in
tests/peers/sglang_main_facts.json (SGLang main cannot be installed: see that file and
docs/engines/sglang.md). The client picks the protocol from the server's routes; every test
here runs on both and must behave the same way for the user.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from lorasync import Adapter, Publisher
from lorasync.runtime._retry import RetryPolicy
from lorasync.engines.sglang import SGLangEngine, pad_ranks
from lorasync.errors import AdapterAlreadyLoadedError, CapacityError, ConfigError, EngineError
from lorasync.testing import make_peft_model, make_tiny_model
from tests.engines.test_sglang import PROMPT, Peer, _contract_server, _reference, clean_peer

FACTS = json.loads((Path(__file__).resolve().parents[1] / "peers" / "sglang_main_facts.json").read_text())
ROUTE = {"tensors": "/load_lora_adapter_from_tensors", "streamed": "/register_lora_adapter"}


@pytest.fixture(scope="module", params=["tensors", "streamed"])
def protocol_server(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    protocol = request.param
    log = tmp_path_factory.mktemp(f"sglang-{protocol}") / "server.log"
    with _contract_server(tiny_model_dir, log, "--lora-protocol", protocol) as url:
        yield protocol, url


@pytest.fixture
def peer(protocol_server: tuple[str, str]) -> Iterator[Peer]:
    protocol, url = protocol_server
    for p in clean_peer(url):
        p.protocol = protocol  # type: ignore[attr-defined]
        yield p


@pytest.fixture
def engine(peer: Peer) -> Iterator[SGLangEngine]:
    with SGLangEngine(peer.url, retries=RetryPolicy(attempts=2, backoff=0.01, jitter=0.0)) as client:
        yield client


def _adapter_dir(root: Path, seed: int) -> Path:
    model = make_peft_model(make_tiny_model(), r=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=seed)
    model.save_pretrained(str(root / f"a{seed}"))
    return root / f"a{seed}"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("protocol-adapters")
    return {seed: _adapter_dir(root, seed) for seed in (11, 12, 13)}


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


def _session_closed(url: str) -> bool:
    """A new session opens (and is closed again) only when none is open."""
    opened = httpx.post(f"{url}/begin_weight_update", json={}).json()["success"]
    if opened:
        httpx.post(f"{url}/end_weight_update", json={})
    return bool(opened)


# -- protocol choice ---------------------------------------------------------------------


def test_protocol_comes_from_the_servers_routes(engine: SGLangEngine, peer: Peer) -> None:
    caps = engine.capabilities()
    protocol = peer.protocol  # type: ignore[attr-defined]
    assert caps.tensor_load
    assert any(ROUTE[protocol] in note for note in caps.notes), caps.notes
    # Both servers report version 0.5.23: only the routes tell them apart.
    assert ("GET", "/openapi.json") in peer.calls()


def test_streamed_peer_serves_the_recorded_route_set(engine: SGLangEngine, peer: Peer) -> None:
    """The peer's route set and request fields are SGLang main's as recorded (no drift between
    the facts file and what the streamed tests run against)."""
    spec = httpx.get(f"{peer.url}/openapi.json").json()
    paths = set(spec["paths"])
    if peer.protocol == "tensors":  # type: ignore[attr-defined]
        assert "/load_lora_adapter_from_tensors" in paths and "/register_lora_adapter" not in paths
        return
    assert set(FACTS["routes"]["added"]) <= paths
    assert not set(FACTS["routes"]["removed"]) & paths
    assert set(FACTS["routes"]["kept"]) <= paths
    schema = spec["components"]["schemas"]["RegisterLoRAAdapterReqInput"]
    assert set(FACTS["structs"]["RegisterLoRAAdapterReqInput"]) <= set(schema["properties"])


# -- publishing: 3 versions, exact tensors, retention --------------------------------------


def test_three_versions_serve_exactly_the_trained_weights(
    engine: SGLangEngine, peer: Peer, dirs: dict[int, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Publisher, ipc transport, keep=2: each version serves PEFT's tokens, the tensors SGLang
    holds are the trainer's bit for bit, and the window keeps the two newest."""
    pub = Publisher([engine], name="pol", transport="ipc", root=tmp_path, keep=2)
    try:
        for version, seed in enumerate((11, 12, 13), start=1):
            adapter = Adapter.load(dirs[seed])
            report = pub.publish(adapter, version=version).settled()
            assert report.ok and report.results[0].transport == "ipc", report
            served = engine.generate(PROMPT, lora_name=f"pol@v{version}", max_new_tokens=4, return_logprob=True)
            tokens, logprobs = _reference(tiny_model_dir, dirs[seed])
            assert list(served.output_ids) == tokens
            assert served.logprobs == pytest.approx(logprobs, abs=1e-4)
            if peer.protocol == "streamed":  # type: ignore[attr-defined]
                held = httpx.get(f"{peer.url}/_contract/stash").json()["digests"][f"pol@v{version}"]
                assert held == {k: _sha(t) for k, t in pad_ranks(adapter).tensors.items()}
        assert engine.list_adapters() == ["pol@v2", "pol@v3"]
        calls = [path for _, path in peer.calls()]
        assert ROUTE[peer.protocol] in calls  # type: ignore[attr-defined]
        if peer.protocol == "streamed":  # type: ignore[attr-defined]
            assert "/load_lora_adapter_from_tensors" not in calls
            assert calls.count("/begin_weight_update") == calls.count("/end_weight_update") == 3
            assert httpx.get(f"{peer.url}/_contract/stash").json()["stash"] == {}
    finally:
        pub.close()


def test_same_content_twice_over_tensors_is_sent_again_because_sglang_cannot_say_which_load_it_serves(
    engine: SGLangEngine, peer: Peer, dirs: dict[int, Path], tmp_path: Path
) -> None:
    """SGLang lists every tensor load as ``__tensor__``: after a restart another job's tensors could
    serve under the same name, so a remote engine's remembered hash is not trusted past the load
    (design invariant 8). Identical content over tensors is loaded again as v2, exactly."""
    pub = Publisher([engine], name="dd", transport="ipc", root=tmp_path, keep=2)
    try:
        assert pub.publish(Adapter.load(dirs[11]), version=1).settled().ok
        peer.reset()
        again = pub.publish(Adapter.load(dirs[11]), version=2).settled()
        assert again.ok and again.results[0].status == "loaded", again
        assert again.served_name == "dd@v2"
        assert ROUTE[peer.protocol] in [p for m, p in peer.calls() if m == "POST"]  # type: ignore[attr-defined]
        assert engine.list_adapters() == ["dd@v1", "dd@v2"]
        first = engine.generate(PROMPT, lora_name="dd@v1", max_new_tokens=4)
        second = engine.generate(PROMPT, lora_name="dd@v2", max_new_tokens=4)
        assert list(first.output_ids) == list(second.output_ids)
    finally:
        pub.close()


def test_same_content_twice_from_disk_moves_nothing_on_either_protocol(
    engine: SGLangEngine, peer: Peer, dirs: dict[int, Path], tmp_path: Path
) -> None:
    """Dedup where SGLang names the load: a disk load is listed with its version directory, whose
    recorded hash is the publisher's own, so v2 with v1's content is "unchanged", served under
    v1's name, with no load request."""
    pub = Publisher([engine], name="dd", transport="disk", root=tmp_path, keep=2)
    try:
        assert pub.publish(Adapter.load(dirs[11]), version=1).settled().ok
        peer.reset()
        again = pub.publish(Adapter.load(dirs[11]), version=2).settled()
        assert again.ok and again.results[0].status == "unchanged", again
        assert again.served_name == "dd@v1"
        moved = [p for m, p in peer.calls() if m == "POST"]
        assert moved == [], moved
        assert engine.list_adapters() == ["dd@v1"]
    finally:
        pub.close()


# -- failures: the previous version keeps serving, nothing partial serves --------------------


@pytest.mark.parametrize("where", ["first", "second"])
def test_a_failed_stream_leaves_the_previous_version_serving(
    where: str, peer: Peer, dirs: dict[int, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """v2's tensors fail on their way (the first request, or the second of several buckets):
    v2 is not listed, v1 still serves exactly, the weight-update session is closed, and v2 can
    be published again."""
    engine = SGLangEngine(peer.url, retries=RetryPolicy(attempts=1), weight_bucket_bytes=4096)
    pub = Publisher([engine], name="f", transport="ipc", root=tmp_path, keep=2)
    try:
        assert pub.publish(Adapter.load(dirs[11]), version=1).settled().ok
        route = "/update_weights_from_tensor" if peer.protocol == "streamed" else ROUTE["tensors"]  # type: ignore[attr-defined]
        if where == "second" and peer.protocol == "tensors":  # type: ignore[attr-defined]
            pytest.skip("the legacy route takes an adapter in one request")
        peer.fail(route, 500) if where == "first" else httpx.post(f"{peer.url}/_contract/fail", json={"path": route, "status": 500, "after": 1})
        report = pub.publish(Adapter.load(dirs[12]), version=2)
        assert not report.ok
        assert isinstance(report.results[0].error, EngineError), report
        assert engine.list_adapters() == ["f@v1"]
        assert list(engine.generate(PROMPT, lora_name="f@v1", max_new_tokens=4).output_ids) == _reference(tiny_model_dir, dirs[11])[0]
        assert _session_closed(peer.url)
        if peer.protocol == "streamed":  # type: ignore[attr-defined]
            state = httpx.get(f"{peer.url}/_contract/stash").json()
            assert state["registered"] == ["f@v1"] and state["stash"] == {}
        again = pub.publish(Adapter.load(dirs[12]), version=2).settled()
        assert again.ok, again
        assert list(engine.generate(PROMPT, lora_name="f@v2", max_new_tokens=4).output_ids) == _reference(tiny_model_dir, dirs[12])[0]
    finally:
        pub.close()
        engine.close()


@pytest.mark.parametrize("step", ["first", "tensors"])
def test_a_cancelled_load_leaves_nothing_registered(step: str, peer: Peer, dirs: dict[int, Path]) -> None:
    """Cancelled while a request is on its way (a slow network) and SGLang handles it after the
    cancellation: afterwards the name is not served and no session is left open. ``first``: the
    registration (streamed) or the whole load (legacy) is the request cut off. Nothing here
    unloads the name: a registration left behind (zero weights) fails the test."""
    protocol = peer.protocol  # type: ignore[attr-defined]
    if step == "tensors" and protocol == "tensors":
        pytest.skip("the legacy route takes an adapter in one request")
    route = "/update_weights_from_tensor" if step == "tensors" else ROUTE[protocol]
    httpx.post(f"{peer.url}/_contract/fail", json={"path": route, "status": 0, "delay": 2.0})
    adapter = Adapter.load(dirs[13])

    async def run() -> None:
        async with SGLangEngine(peer.url) as client:
            task = asyncio.create_task(client.aload_adapter_tensors("c@v1", adapter))
            while not any(r["path"] == route for r in peer.requests()):
                await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(run())
    time.sleep(2.5)  # the cut-off request has reached SGLang by now, whatever the client did
    with SGLangEngine(peer.url) as client:
        assert "c@v1" not in client.list_adapters()
    if protocol == "streamed":
        assert httpx.get(f"{peer.url}/_contract/stash").json()["registered"] == []
    assert _session_closed(peer.url)


@pytest.mark.parametrize("step", ["load", "begin", "end"])
def test_a_load_whose_answer_is_lost_is_undone_and_the_retry_serves_exactly(
    step: str, peer: Peer, dirs: dict[int, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """v2's registration (streamed) or load (legacy), its session's begin or its end lands, but
    the answer is lost (a proxy's 502): the publish fails, v2 is not listed (never with zero or
    partial weights), v1 serves exactly, no session is left open, and the same v2 published
    again serves exactly; keep=2 then keeps v2 and v3, both exact."""
    protocol = peer.protocol  # type: ignore[attr-defined]
    if step != "load" and protocol == "tensors":
        pytest.skip("the legacy route opens no session")
    engine = SGLangEngine(peer.url, retries=RetryPolicy(attempts=1))
    pub = Publisher([engine], name="lost", transport="ipc", root=tmp_path, keep=2)
    try:
        assert pub.publish(Adapter.load(dirs[11]), version=1).settled().ok
        peer.lose({"load": ROUTE[protocol], "begin": "/begin_weight_update", "end": "/end_weight_update"}[step])  # type: ignore[attr-defined]
        report = pub.publish(Adapter.load(dirs[12]), version=2)
        assert not report.ok and isinstance(report.results[0].error, EngineError), report
        assert engine.list_adapters() == ["lost@v1"]
        if protocol == "streamed":
            assert httpx.get(f"{peer.url}/_contract/stash").json()["registered"] == ["lost@v1"]
        assert _session_closed(peer.url)
        assert list(engine.generate(PROMPT, lora_name="lost@v1", max_new_tokens=4).output_ids) == _reference(tiny_model_dir, dirs[11])[0]
        for version, seed in ((2, 12), (3, 13)):
            again = pub.publish(Adapter.load(dirs[seed]), version=version).settled()
            assert again.ok and again.results[0].status == "loaded", again
        assert engine.list_adapters() == ["lost@v2", "lost@v3"]
        for version, seed in ((2, 12), (3, 13)):
            served = engine.generate(PROMPT, lora_name=f"lost@v{version}", max_new_tokens=4, return_logprob=True)
            tokens, logprobs = _reference(tiny_model_dir, dirs[seed])
            assert list(served.output_ids) == tokens
            assert served.logprobs == pytest.approx(logprobs, abs=1e-4)
    finally:
        pub.close()
        engine.close()


def test_concurrent_loads_take_turns_for_the_one_session(peer: Peer, dirs: dict[int, Path], tiny_model_dir: Path) -> None:
    """SGLang allows one weight-update session at a time: four loads at once, from one client and
    from a second client of the same server, all succeed and each serves its own weights."""
    seeds = {f"t{i}@v1": 11 + i % 3 for i in range(4)}  # the peer has 4 slots

    async def run() -> None:
        async with SGLangEngine(peer.url) as one, SGLangEngine(peer.url) as two:
            clients = [one, two]
            await asyncio.gather(
                *(clients[i % 2].aload_adapter_tensors(name, Adapter.load(dirs[seed])) for i, (name, seed) in enumerate(seeds.items()))
            )

    asyncio.run(run())
    with SGLangEngine(peer.url) as client:
        assert client.list_adapters() == sorted(seeds)
        for name, seed in seeds.items():
            assert list(client.generate(PROMPT, lora_name=name, max_new_tokens=4).output_ids) == _reference(tiny_model_dir, dirs[seed])[0]
    if peer.protocol == "streamed":  # type: ignore[attr-defined]
        calls = [path for _, path in peer.calls()]
        assert calls.count("/begin_weight_update") == calls.count("/end_weight_update") == 4
    assert _session_closed(peer.url)


def test_concurrent_loads_through_two_spellings_of_one_server_take_turns(peer: Peer, dirs: dict[int, Path], tiny_model_dir: Path) -> None:
    """Two clients of one server written ``http://127.0.0.1:P`` and ``http://localhost:P/`` (two
    publishers of one job, say) share its one session: four loads at once all succeed, each
    serving its own weights (they were two gates, and a streamed load failed with "a
    weight-update session is already open")."""
    port = peer.url.rsplit(":", 1)[1]
    seeds = {f"t{i}@v1": 11 + i % 2 for i in range(4)}

    async def run() -> None:
        async with SGLangEngine(f"http://127.0.0.1:{port}") as one, SGLangEngine(f"http://localhost:{port}/") as two:
            clients = [one, two]
            await asyncio.gather(
                *(clients[i % 2].aload_adapter_tensors(name, Adapter.load(dirs[seed])) for i, (name, seed) in enumerate(seeds.items()))
            )

    asyncio.run(run())
    with SGLangEngine(peer.url) as client:
        assert client.list_adapters() == sorted(seeds)
        for name, seed in seeds.items():
            assert list(client.generate(PROMPT, lora_name=name, max_new_tokens=4).output_ids) == _reference(tiny_model_dir, dirs[seed])[0]
    assert _session_closed(peer.url)


def test_loading_a_served_name_again_is_refused_and_keeps_it_serving(engine: SGLangEngine, dirs: dict[int, Path], tiny_model_dir: Path) -> None:
    engine.load_adapter_tensors("s@v1", Adapter.load(dirs[11]))
    with pytest.raises(AdapterAlreadyLoadedError):
        engine.load_adapter_tensors("s@v1", Adapter.load(dirs[12]))
    assert list(engine.generate(PROMPT, lora_name="s@v1", max_new_tokens=4).output_ids) == _reference(tiny_model_dir, dirs[11])[0]


# -- streamed-only rules -------------------------------------------------------------------


def test_streamed_names_may_not_contain_a_colon(engine: SGLangEngine, peer: Peer, dirs: dict[int, Path]) -> None:
    if peer.protocol != "streamed":  # type: ignore[attr-defined]
        pytest.skip("the legacy route names the adapter in a field of its own")
    peer.reset()
    with pytest.raises(ConfigError, match="colon"):
        engine.load_adapter_tensors("team:pol@v1", Adapter.load(dirs[11]))
    assert not [p for _, p in peer.calls() if p.startswith(("/register", "/begin", "/update"))]


def test_a_new_streamed_name_past_max_loaded_loras_is_refused(engine: SGLangEngine, peer: Peer, dirs: dict[int, Path]) -> None:
    """SGLang main never evicts a streamed adapter (it holds the only copy): the fifth name on a
    --max-loaded-loras 4 server is refused with CapacityError, and the four keep serving."""
    if peer.protocol != "streamed":  # type: ignore[attr-defined]
        pytest.skip("0.5.23 evicts the least recently used adapter instead")
    adapter = Adapter.load(dirs[11])
    for i in range(4):
        engine.load_adapter_tensors(f"cap@v{i}", adapter)
    with pytest.raises(CapacityError, match="max-loaded-loras"):
        engine.load_adapter_tensors("cap@v9", adapter)
    assert engine.list_adapters() == [f"cap@v{i}" for i in range(4)]


def test_publisher_makes_room_on_a_full_streamed_server(engine: SGLangEngine, peer: Peer, dirs: dict[int, Path], tmp_path: Path) -> None:
    """keep=3 on a 4-slot server where another adapter holds a slot: the publisher unloads the
    version leaving the window before it registers the next, so the streamed server's refusal of
    new names never trips."""
    engine.load_adapter_tensors("other@v1", Adapter.load(dirs[13]))
    pub = Publisher([engine], name="room", transport="ipc", root=tmp_path, keep=3)
    try:
        for version in range(1, 6):
            report = pub.publish(Adapter.load(dirs[11 + version % 2]), version=version).settled()
            assert report.ok, report
        assert engine.list_adapters() == ["other@v1", "room@v3", "room@v4", "room@v5"]
    finally:
        pub.close()
