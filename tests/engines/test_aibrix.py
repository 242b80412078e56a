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
        for n, _ in enumerate(response.iter_lines()):
            if n == 20:  # decoding now
                for _ in range(50):
                    seen |= engine.adapters_in_use() or set()
                    if seen:
                        break
                    time.sleep(0.05)
    assert seen == {"inflight@v1"}, seen
