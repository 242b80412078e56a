"""Publishing through AIBrix's runtime sidecar (the real ``aibrix_runtime`` of pip ``aibrix`` 0.8.0,
in its own venv) in front of the real vLLM CPU server, as an AIBrix deployment does:

* the engine conformance suite, through the sidecar;
* a trainer's run: many steps with verification, requests decoding v1 while v2 publishes, each
  version exact against PEFT when requested by its AIBrix name, old versions unloaded through the
  sidecar, then a second run after the first on the same root;
* what the sidecar hides (an unload it answers "success" for whatever vLLM said) is read from
  vLLM; a sidecar of another server is refused; a stopped sidecar is a typed, reported error and
  the next publish after its restart serves the version;
* names: the spelling in AIBrix's alphabet is injective and round-trips (property-based), and a
  name it cannot take is a typed error before anything loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lorasync import Probe, Publisher
from lorasync.adapter._names import MAX_NAME, parse_served_name, served_name
from lorasync.engines import connect
from lorasync.engines.aibrix import AIBrixEngine, request_name, served_from_request
from lorasync.errors import ConfigError, EngineUnavailableError, InvalidNameError
from lorasync.exporters.fsdp import export
from lorasync.testing import EngineConformance, make_peft_model, make_tiny_model
from lorasync.testing.aibrix_sidecar import AIBrixSidecar
from lorasync.testing.vllm_server import VLLMServer

from tests.support.greedy import peft_greedy as reference

PROMPTS = ([5, 17, 99, 230, 41], [300, 12, 7])


# -- names (no servers) -----------------------------------------------------------------------------

NAMES = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,40}", fullmatch=True).filter(lambda n: ".." not in n)  # lorasync names


@settings(max_examples=300, deadline=None)
@given(name=NAMES, version=st.integers(min_value=0, max_value=10**12))
def test_a_versioned_name_round_trips_through_aibrix_spelling(name: str, version: int) -> None:
    served = served_name(name, version)
    wire = request_name(served)
    assert wire.replace("-", "").replace("_", "").isalnum() and wire.isascii()  # the sidecar's own rule
    assert served_from_request(wire) == served


@settings(max_examples=300, deadline=None)
@given(a=st.tuples(NAMES, st.integers(0, 10**6)), b=st.tuples(NAMES, st.integers(0, 10**6)))
def test_two_versioned_names_never_share_a_spelling(a: tuple[str, int], b: tuple[str, int]) -> None:
    if a != b:
        assert request_name(served_name(*a)) != request_name(served_name(*b))


@settings(max_examples=300, deadline=None)
@given(raw=st.from_regex(r"[A-Za-z0-9_-]{1,60}", fullmatch=True))
def test_a_plain_name_is_itself_or_refused_never_read_as_a_version(raw: str) -> None:
    try:
        wire = request_name(raw)
    except InvalidNameError as exc:
        assert parse_served_name(served_from_request(raw)) is not None, exc  # it spells a version
        return
    assert wire == raw and served_from_request(raw) == raw


def test_names_aibrix_cannot_take_are_typed_errors() -> None:
    assert request_name("policy@v3") == "policy_v3" and request_name("my_run.a@v12") == "my__run_da_v12"
    with pytest.raises(InvalidNameError, match="letters, digits"):
        request_name("bad name")
    with pytest.raises(InvalidNameError, match="spells 'pol@v3'"):
        request_name("pol_v3")
    with pytest.raises(InvalidNameError, match="at most 100"):
        request_name(served_name("a" + "_" * 59, 1))  # 121 characters as AIBrix serves it
    # A name vLLM lists that lorasync would read as its own, but that AIBrix cannot have loaded.
    assert parse_served_name(served_from_request("x@v3")) is None
    assert served_from_request(7) == 7  # an odd value an engine lists stays foreign, as it is  # type: ignore[arg-type]


# -- the real sidecar -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sidecar(aibrix_python: Path, vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AIBrixSidecar]:
    log = tmp_path_factory.mktemp("aibrix-logs") / "sidecar.log"
    with AIBrixSidecar(vllm_server.url, python=aibrix_python, log_path=log) as process:
        yield process


@pytest.fixture
def engine(vllm_server: VLLMServer, sidecar: AIBrixSidecar) -> Iterator[AIBrixEngine]:
    with AIBrixEngine(vllm_server.url, sidecar=sidecar.url, timeout=120.0) as client:
        yield client
        for name in client.list_adapters():  # the shared server serves no adapter of ours afterwards
            if "#" not in name:
                client.unload_adapter(name)


def raw_names(server: VLLMServer) -> set[str]:
    """What vLLM itself lists (not through lorasync): the names requests use."""
    cards = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    return {c["id"] for c in cards if c.get("parent")}


def complete(server: VLLMServer, model: str, prompt: list[int], n: int = 6) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, (model, response.status_code, response.text[:300])
    return list(response.json()["choices"][0]["token_ids"])


def trained(seed: int) -> torch.nn.Module:
    return make_peft_model(make_tiny_model(), r=8, seed=seed)


@pytest.mark.vllm
class TestConformanceThroughTheSidecar(EngineConformance):
    @pytest.fixture
    def engine(self, vllm_server: VLLMServer, sidecar: AIBrixSidecar) -> Iterator[AIBrixEngine]:
        with AIBrixEngine(vllm_server.url, sidecar=sidecar.url, timeout=120.0) as client:
            yield client


@pytest.mark.vllm
def test_a_trainer_run_through_the_sidecar_serves_every_version_exactly(
    engine: AIBrixEngine, vllm_server: VLLMServer, sidecar: AIBrixSidecar, tmp_path: Path
) -> None:
    name = "aibrix.run_1"  # '.' and '_' are not AIBrix's: spelled aibrix_drun__1_vN
    caps = engine.capabilities()
    assert caps.engine == "aibrix" and not caps.tensor_load and not caps.weight_update
    models: dict[int, torch.nn.Module] = {}
    with Publisher([engine], name=name, keep=2, root=tmp_path) as pub:
        for version in (1, 2, 3, 4):
            models[version] = trained(seed=60 + version)
            probe = Probe.from_model(models[version], list(PROMPTS[0]), max_tokens=4, atol=1e-3)
            stop, seen, failures = threading.Event(), [], []
            thread = None
            if version == 2:
                # Rollouts of v1 keep decoding while v2 publishes: always v1's tokens.
                want = reference(models[1], list(PROMPTS[1]))

                def rollouts() -> None:
                    while not stop.is_set():
                        try:
                            seen.append(complete(vllm_server, request_name(f"{name}@v1"), list(PROMPTS[1])) == want)
                        except AssertionError as exc:
                            failures.append(exc)

                thread = threading.Thread(target=rollouts)
                thread.start()
                while not seen and not failures and thread.is_alive():
                    time.sleep(0.05)
            try:
                report = pub.publish(export(models[version]), version=version, verify=probe)
            finally:
                stop.set()
                if thread is not None:
                    thread.join()
            assert report.ok, report
            result = report.results[0]
            assert result.status == "loaded" and result.transport == "disk" and "verified" in result.reason, report
            assert report.served_name == f"{name}@v{version}"
            for prompt in PROMPTS:
                assert complete(vllm_server, request_name(report.served_name), list(prompt)) == reference(models[version], list(prompt))
            if version == 2:
                assert failures == [] and seen and all(seen), (failures, seen)
            report.settled()
            kept = {f"{name}@v{v}" for v in (version - 1, version) if v >= 1}
            assert set(engine.list_adapters()) == kept
            assert raw_names(vllm_server) == {request_name(n) for n in kept}  # old versions left vLLM itself
    # The unloads went through the sidecar (it logs each), never around it.
    assert f"Unloading adapter {request_name(f'{name}@v1')}" in sidecar.log_text()
    # A second run after the first, on the same root: it takes over what the engine serves.
    model = trained(seed=70)
    with Publisher([engine], name=name, keep=2, root=tmp_path) as again:
        report = again.publish(export(model), version=5, verify=Probe.from_model(model, list(PROMPTS[0]), max_tokens=4, atol=1e-3))
        assert report.ok, report
        report.settled()
        assert complete(vllm_server, request_name(report.served_name), list(PROMPTS[1])) == reference(model, list(PROMPTS[1]))
        assert set(engine.list_adapters()) == {f"{name}@v4", f"{name}@v5"}


@pytest.mark.vllm
def test_two_jobs_on_one_host_publish_through_one_sidecar_and_each_keeps_only_its_own(
    engine: AIBrixEngine, vllm_server: VLLMServer, sidecar: AIBrixSidecar, tmp_path: Path
) -> None:
    # Two trainers on one host (one root, each its own run), one vLLM behind one sidecar: they
    # publish the same step numbers at the same time, then one retires while the other has not
    # moved on. Every version each job reports serves its own weights, and each job's retention
    # unloads only its own versions, never the other's (not even its same-numbered one).
    names = ("job-a", "job-b")
    models = {(n, v): trained(seed=80 + 10 * i + v) for i, n in enumerate(names) for v in (1, 2, 3)}
    clients = {n: AIBrixEngine(vllm_server.url, sidecar=sidecar.url, timeout=120.0) for n in names}
    pubs = {n: Publisher([clients[n]], name=n, keep=2, root=tmp_path) for n in names}
    together = threading.Barrier(len(names))
    failures: list[BaseException] = []

    def publish(name: str, version: int) -> None:
        report = pubs[name].publish(export(models[(name, version)]), version=version)
        assert report.ok and report.results[0].status == "loaded", report
        report.settled()

    def steps(name: str) -> None:
        try:
            for version in (1, 2):
                together.wait(120)  # both jobs' publishes of this step run at once
                publish(name, version)
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread below
            failures.append(exc)
            together.abort()

    try:
        threads = [threading.Thread(target=steps, args=(n,)) for n in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        assert not any(t.is_alive() for t in threads) and failures == [], failures
        assert set(engine.list_adapters()) == {f"{n}@v{v}" for n in names for v in (1, 2)}
        publish("job-a", 3)  # job-a retires its v1; job-b has not published v3 yet
        assert set(engine.list_adapters()) == {"job-a@v2", "job-a@v3", "job-b@v1", "job-b@v2"}
        publish("job-b", 3)
    finally:
        for name in names:
            pubs[name].close()
            clients[name].close()
    kept = {f"{n}@v{v}" for n in names for v in (2, 3)}
    assert set(engine.list_adapters()) == kept
    assert raw_names(vllm_server) == {request_name(n) for n in kept}
    for n in names:
        for v in (2, 3):
            assert complete(vllm_server, request_name(f"{n}@v{v}"), list(PROMPTS[1])) == reference(models[(n, v)], list(PROMPTS[1]))


@pytest.mark.vllm
def test_the_sidecars_unload_answer_is_not_believed(engine: AIBrixEngine, vllm_server: VLLMServer, sidecar: AIBrixSidecar, tmp_path: Path) -> None:
    # aibrix 0.8.0 answers 200 "success" to an unload vLLM refused; lorasync asks vLLM.
    answer = httpx.post(f"{sidecar.url}/v1/lora_adapter/unload", json={"lora_name": "never_loaded_here"}, timeout=30)
    assert answer.status_code == 200 and "Successfully" in answer.text
    from lorasync.errors import AdapterNotFoundError

    with pytest.raises(AdapterNotFoundError, match="does not serve"):
        engine.unload_adapter("never-loaded-here")
    export(trained(seed=80)).save(tmp_path / "a")
    engine.load_adapter("sidecar@v1", tmp_path / "a")
    assert "sidecar_v1" in raw_names(vllm_server) and "sidecar@v1" in engine.list_adapters()
    assert engine.adapter_sources() == {"sidecar@v1": str(tmp_path / "a")}
    engine.unload_adapter("sidecar@v1")
    assert "sidecar_v1" not in raw_names(vllm_server)
    assert (tmp_path / "a" / "adapter_config.json").is_file()  # cleanup_local=false: nothing of ours deleted


@pytest.mark.vllm
def test_a_sidecar_of_another_server_is_refused(aibrix_python: Path, vllm_server: VLLMServer, dead_url: str, tmp_path: Path) -> None:
    with AIBrixSidecar(dead_url, python=aibrix_python, log_path=tmp_path / "other.log") as other:
        with AIBrixEngine(vllm_server.url, sidecar=other.url, timeout=30.0, retries=0) as engine, pytest.raises(ConfigError, match="drives a vLLM"):
            engine.capabilities()


@pytest.mark.vllm
def test_a_stopped_sidecar_is_a_reported_error_and_the_next_publish_after_its_restart_serves(
    aibrix_python: Path, vllm_server: VLLMServer, tmp_path: Path
) -> None:
    process = AIBrixSidecar(vllm_server.url, python=aibrix_python, log_path=tmp_path / "restart.log").start()
    port = process.port
    engine = connect("aibrix", vllm_server.url, sidecar=process.url, timeout=30.0, retries=0)
    model = trained(seed=90)
    try:
        with Publisher([engine], name="restarting", keep=1, root=tmp_path / "root") as pub:
            assert pub.publish(export(model), version=1).ok
            process.stop()
            failed = pub.publish(export(trained(seed=91)), version=2)
            assert not failed.ok and isinstance(failed.results[0].error, EngineUnavailableError), failed
            assert "restarting@v2" not in engine.list_adapters()
            process = AIBrixSidecar(vllm_server.url, python=aibrix_python, port=port, log_path=tmp_path / "restart2.log").start()
            again = trained(seed=92)
            report = pub.publish(export(again), version=3, verify=Probe.from_model(again, list(PROMPTS[0]), max_tokens=4, atol=1e-3))
            assert report.ok, report
            report.settled()
            assert complete(vllm_server, request_name("restarting@v3"), list(PROMPTS[0])) == reference(again, list(PROMPTS[0]))
    finally:
        for name in engine.list_adapters():
            if name.startswith("restarting@"):
                engine.unload_adapter(name)
        engine.close()
        process.stop()


@pytest.mark.vllm
def test_a_name_too_long_for_aibrix_is_a_typed_error_before_anything_loads(engine: AIBrixEngine, vllm_server: VLLMServer, tmp_path: Path) -> None:
    name = "long" + "_" * 60  # valid for lorasync (at most MAX_NAME), 127 characters as AIBrix spells it
    with Publisher([engine], name=name, root=tmp_path) as pub:
        report = pub.publish(export(trained(seed=95)), version=1)
    assert not report.ok and isinstance(report.results[0].error, InvalidNameError), report
    assert "at most 100" in str(report.results[0].error)
    assert len(name) <= MAX_NAME and not any(n.startswith("long") for n in raw_names(vllm_server))


@pytest.mark.vllm
def test_requests_in_flight_are_read_under_lorasyncs_names(engine: AIBrixEngine, vllm_server: VLLMServer, tmp_path: Path) -> None:
    export(trained(seed=97)).save(tmp_path / "a")
    engine.load_adapter("inflight@v1", tmp_path / "a")
    body = {"model": request_name("inflight@v1"), "prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0.0, "ignore_eos": True, "stream": True}
    seen: set[str] = set()
    with httpx.stream("POST", f"{vllm_server.url}/v1/completions", json=body, timeout=120) as response:
        asked = 0.0
        for n, _ in enumerate(response.iter_lines()):
            # Decoding from line 20 on: asked while the stream goes on (vLLM's gauge lags a step,
            # and more on a loaded host), never after the request ended.
            if n >= 20 and not seen and time.monotonic() - asked > 0.1:
                seen |= engine.adapters_in_use() or set()
                asked = time.monotonic()
    assert seen == {"inflight@v1"}, seen


# -- from the outside attack (2026-12-07): the sidecar's answers that hide what vLLM did ---------------


@pytest.mark.vllm
def test_a_rank_over_the_servers_maximum_is_typed_although_the_sidecar_drops_vllms_reason(engine: AIBrixEngine, tmp_path: Path) -> None:
    from lorasync.errors import RankTooLargeError

    export(make_peft_model(make_tiny_model(), r=32, seed=3)).save(tmp_path / "r32")  # the shared server takes r <= 16
    with pytest.raises(RankTooLargeError) as caught:
        engine.load_adapter("toobig@v1", tmp_path / "r32")
    assert caught.value.rank == 32 and caught.value.max_rank == engine.capabilities().max_rank


@pytest.mark.vllm
def test_a_name_loaded_around_aibrix_is_listed_foreign_and_can_still_be_asked_for(engine: AIBrixEngine, vllm_server: VLLMServer, tmp_path: Path) -> None:
    from lorasync.engines.vllm import VLLMEngine

    export(trained(seed=5)).save(tmp_path / "a")
    with VLLMEngine(vllm_server.url) as plain:
        plain.load_adapter("around@v3", tmp_path / "a")
        try:
            listed = [n for n in engine.list_adapters() if n.startswith("around")]
            assert listed == ["around@v3#loaded-around-aibrix"] and parse_served_name(listed[0]) is None
            assert engine.generate(list(PROMPTS[0]), model=listed[0]).token_ids == plain.generate(list(PROMPTS[0]), model="around@v3").token_ids
        finally:
            plain.unload_adapter("around@v3")


@pytest.mark.vllm
def test_a_second_load_of_a_name_says_what_aibrix_allows_and_names_the_sidecars_route(engine: AIBrixEngine, sidecar: AIBrixSidecar, tmp_path: Path) -> None:
    from lorasync.errors import AdapterAlreadyLoadedError

    export(trained(seed=6)).save(tmp_path / "a")
    engine.load_adapter("twice@v1", tmp_path / "a")
    with pytest.raises(AdapterAlreadyLoadedError) as caught:
        engine.load_adapter("twice@v1", tmp_path / "a")
    assert "load_inplace=True" not in str(caught.value) and "no in-place load" in str(caught.value)
    assert caught.value.url == f"{sidecar.url}/v1/lora_adapter/load"


VLLM_AT, SIDECAR_AT = "http://127.0.0.1:9", "http://127.0.0.1:10"


class Recorded:
    """vLLM and the sidecar as aibrix 0.8.0 answers (the texts recorded from the real ones), for the
    cases the real pair cannot be made to show on demand: the sidecar's own retry after its 30 s
    read timeout, a sidecar driving another replica, a vLLM with a key the sidecar lacks, a vLLM
    without runtime loading. ``load``: the sidecar's answer; ``lands``: whether vLLM then lists it."""

    def __init__(self, load: httpx.Response, *, lands: bool, route: int = 405) -> None:
        self.load, self.lands, self.route = load, lands, route
        self.listed: dict[str, str] = {}
        self.seen: list[tuple[str, str, httpx.Headers, bytes]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        where = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        self.seen.append((where, request.url.path, request.headers, request.content))
        if where == VLLM_AT and request.url.path == "/v1/models":
            cards = [{"id": "tiny-base", "root": "/m", "parent": None}] + [{"id": n, "root": r, "parent": "tiny-base"} for n, r in self.listed.items()]
            return httpx.Response(200, json={"object": "list", "data": cards})
        if where == VLLM_AT and request.url.path == "/v1/load_lora_adapter":
            return httpx.Response(self.route, json={"detail": "Not Found" if self.route == 404 else "Method Not Allowed"})
        if where == SIDECAR_AT and request.url.path == "/v1/lora_adapter/load":
            sent = json.loads(request.content)
            if self.lands:
                self.listed[sent["lora_name"]] = sent["lora_path"]
            return self.load
        if where == SIDECAR_AT and request.url.path == "/v1/lora_adapter/unload":
            return httpx.Response(200, json={"status": "success", "message": "Successfully unloaded adapter"})
        return httpx.Response(404, json={"detail": "Not Found"})


def recorded_engine(recorded: Recorded, **options: object) -> AIBrixEngine:
    return AIBrixEngine(VLLM_AT, sidecar=SIDECAR_AT, transport=httpx.MockTransport(recorded), retries=0, timeout=5.0, **options)  # type: ignore[arg-type]


ALREADY = httpx.Response(400, json={"object": "error", "message": "Failed to load LoRA adapter 'r_v1': {\"error\":{\"message\":\"The lora adapter 'r_v1' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.\",\"type\":\"InvalidUserInput\",\"param\":null,\"code\":400}}", "type": "ServerError", "param": None, "code": 400})
SUCCESS = httpx.Response(200, text="Success: LoRA adapter 'r_v1' loaded successfully from '/x'.")


def test_a_load_the_sidecar_retried_past_its_timeout_counts_once_the_server_lists_it(tmp_path: Path) -> None:
    # Its first attempt landed after its 30 s read timeout; its retry answers "already loaded".
    recorded = Recorded(ALREADY, lands=True)
    with recorded_engine(recorded) as engine:
        engine.load_adapter("r@v1", tmp_path)
        assert engine.list_adapters() == ["r@v1"]


def test_a_load_another_replica_took_is_refused_and_taken_out_there(tmp_path: Path) -> None:
    recorded = Recorded(SUCCESS, lands=False)  # the sidecar's vLLM is not the server this engine reads
    with recorded_engine(recorded) as engine, pytest.raises(ConfigError, match="other than the server"):
        engine.load_adapter("r@v1", tmp_path)
    unloads = [body for where, path, _, body in recorded.seen if where == SIDECAR_AT and path == "/v1/lora_adapter/unload"]
    assert unloads and b'"cleanup_local":false' in unloads[0].replace(b" ", b"")


def test_a_key_the_sidecar_lacks_names_its_variable_and_the_callers_key_never_goes_there(tmp_path: Path) -> None:
    from lorasync.errors import AuthenticationError

    recorded = Recorded(httpx.Response(401, json={"error": "Unauthorized"}), lands=False)
    with recorded_engine(recorded, api_key="sk-never-to-the-sidecar") as engine, pytest.raises(AuthenticationError, match="INFERENCE_ENGINE_API_KEY") as caught:
        engine.load_adapter("r@v1", tmp_path)
    assert "sk-never" not in str(caught.value)
    assert all("sk-never" not in str(headers) for where, _, headers, _ in recorded.seen if where == SIDECAR_AT)
    assert any("sk-never" in headers.get("authorization", "") for where, _, headers, _ in recorded.seen if where == VLLM_AT)


def test_runtime_loading_off_is_said_although_the_sidecar_calls_it_a_missing_path(tmp_path: Path) -> None:
    from lorasync.errors import RuntimeLoraDisabledError

    missing = httpx.Response(404, json={"object": "error", "message": f"LoRA path '{tmp_path}' not found", "type": "NotFoundError", "param": None, "code": 404})
    with recorded_engine(Recorded(missing, lands=False, route=404)) as engine, pytest.raises(RuntimeLoraDisabledError):
        engine.load_adapter("r@v1", tmp_path)
    from lorasync.errors import AdapterNotFoundError

    with recorded_engine(Recorded(missing, lands=False, route=405)) as engine, pytest.raises(AdapterNotFoundError):
        engine.load_adapter("r@v1", tmp_path)


def test_the_callers_transport_carries_the_sidecars_requests_and_an_empty_sidecar_url_is_refused(tmp_path: Path) -> None:
    recorded = Recorded(SUCCESS, lands=True)
    with recorded_engine(recorded) as engine:
        engine.load_adapter("r@v1", tmp_path)
    assert (SIDECAR_AT, "/v1/lora_adapter/load") in [(w, p) for w, p, _, _ in recorded.seen]
    with pytest.raises(ConfigError, match="sidecar"):
        AIBrixEngine(VLLM_AT, sidecar="")


# -- from the second outside attack (2026-12-07) ---------------------------------------------------------

ERROR_500 = httpx.Response(500, json={"object": "error", "message": "Unexpected error loading LoRA adapter", "type": "ServerError", "param": None, "code": 500})


@pytest.mark.parametrize("config", ["fifo", "nested", "directory"])
def test_the_rank_diagnosis_of_a_5xx_never_blocks_or_raises_untyped(tmp_path: Path, config: str) -> None:
    from lorasync.errors import EngineError

    target = tmp_path / "adapter_config.json"
    if config == "fifo":
        os.mkfifo(target)  # opened as a plain file, the read would wait for a writer forever
    elif config == "nested":
        target.write_text("[" * 100_000)  # json.loads: RecursionError
    else:
        target.mkdir()
    with recorded_engine(Recorded(ERROR_500, lands=False)) as engine, pytest.raises(EngineError) as caught:
        engine.load_adapter("r@v1", tmp_path)
    assert type(caught.value).__name__ != "RankTooLargeError"


def test_a_remote_server_is_not_diagnosed_from_this_hosts_files(tmp_path: Path) -> None:
    from lorasync.errors import RankTooLargeError

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4096}))  # what lies here, not there
    with recorded_engine(Recorded(ERROR_500, lands=False), same_host=False, max_rank=16) as engine, pytest.raises(Exception) as caught:
        engine.load_adapter("r@v1", tmp_path)
    assert not isinstance(caught.value, RankTooLargeError)


def test_odd_listings_stay_foreign_and_odd_model_cards_are_compared_as_text() -> None:
    long = "x_v" + "1" * 5000  # past Python's int() digit limit
    assert served_from_request(long) == long
    with pytest.raises(InvalidNameError):
        request_name(long)
    from lorasync.engines._aibrix_sidecar import bases as _bases

    answer = httpx.Response(200, json={"data": [{"id": "tiny", "root": {"an": "object"}, "parent": None}]})
    assert _bases(answer) == {("tiny", "{'an': 'object'}")}


def test_a_sidecar_url_without_the_load_route_is_said_to_be_no_sidecar(tmp_path: Path) -> None:
    fastapi_404 = httpx.Response(404, json={"detail": "Not Found"})  # vLLM's own URL given as the sidecar, say
    with recorded_engine(Recorded(fastapi_404, lands=False)) as engine, pytest.raises(ConfigError, match="no /v1/lora_adapter/load route"):
        engine.load_adapter("r@v1", tmp_path)


def test_a_sidecar_that_cannot_start_leaves_no_folder_or_open_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(OSError):
        AIBrixSidecar("http://127.0.0.1:9", python=tmp_path / "no-such-python", log_path=tmp_path / "s.log").start()
    assert not list(tmp_path.glob("aibrix-metrics-*"))


def test_a_stopped_helper_leaves_no_member_of_its_group_running(tmp_path: Path) -> None:
    import subprocess
    import sys

    from lorasync.testing._group import GroupProcess, group_alive

    member = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    leader = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {member!r}]); time.sleep(120)"

    class Helper(GroupProcess):
        def start(self) -> "Helper":
            self._proc = subprocess.Popen([sys.executable, "-c", leader], start_new_session=True)
            return self

    helper = Helper().start()
    pgid = helper._proc.pid  # type: ignore[union-attr]
    deadline = time.monotonic() + 30
    while len([p for p in os.listdir("/proc") if p.isdigit() and _pgrp(p) == pgid]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # the member that ignores SIGTERM runs
    helper.stop(timeout=1.0)  # the leader exits on SIGTERM; the member is killed
    assert not group_alive(pgid)
    helper.stop()  # again: nothing to do


def test_a_member_whose_main_thread_exited_is_still_stopped(tmp_path: Path) -> None:
    # Its main thread left with pthread_exit while a worker thread ran on: /proc/<pid>/stat says
    # "Z", and the group was taken for gone without a SIGKILL (found by an outside attack).
    import subprocess
    import sys

    from lorasync.testing._group import group_alive, stop_group

    marker = tmp_path / "beats"
    member = (
        "import ctypes, signal, sys, threading, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "def work():\n"
        "    while True:\n"
        "        with open(sys.argv[1], 'a') as f:\n"
        "            f.write('x')\n"
        "        time.sleep(0.05)\n"
        "threading.Thread(target=work).start()\n"
        "time.sleep(0.3)\n"
        "ctypes.CDLL(None).pthread_exit(None)\n"
    )
    leader = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {member!r}, {str(marker)!r}]); time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", leader], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (marker.exists() and marker.stat().st_size > 10) and time.monotonic() < deadline:
            time.sleep(0.05)  # the worker beats, after the main thread has gone
        assert group_alive(proc.pid)
        stop_group(proc, 1.0)
        assert not group_alive(proc.pid)
        size = marker.stat().st_size
        time.sleep(0.3)
        assert marker.stat().st_size == size  # nothing of the group runs on
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # only the group this test started


def _pgrp(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[2])
    except (OSError, ValueError, IndexError):
        return None
