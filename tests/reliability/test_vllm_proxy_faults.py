"""Faults of the fake engine (``_faultserver.py``) replayed against the REAL vLLM CPU server.

``test_faults.py``, ``test_concurrency.py`` and ``test_crash.py`` name vLLM but run against a
hand-written fake, which answers as its author believed vLLM answers. Here a fault-injecting proxy
(``tests/support/fault_proxy.py``) sits between the real lorasync ``Publisher`` and the suite's
real vLLM server: the engine really does what it is asked (a load lands), only what the client
sees of it is faulted (an empty 200, an answer dropped, connections refused, an answer past the
timeout). Each test then asks the real server directly, not through the proxy, what a user cares
about: which versions it lists and which tokens each serves, compared with PEFT's greedy tokens
of the version that should serve.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from lorasync import Publisher, RetryPolicy
from lorasync.engines import connect
from lorasync.engines.vllm import VLLMEngine
from lorasync.engines.vllm._protocol import IPC_PREFIX
from lorasync.errors import EngineError, EngineTimeoutError, EngineUnavailableError
from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model

from tests.support.fault_proxy import FaultProxy

pytestmark = pytest.mark.vllm

LOAD = "/v1/load_lora_adapter"
PROMPTS = ([5, 17, 99, 230, 41], [300, 12, 7])
NEW_TOKENS = 6


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a busy 2-core box: PEFT's reference generation on one thread
    yield
    torch.set_num_threads(before)


def _greedy(model: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def versions(tiny_model_dir: Path) -> dict[int, tuple[Any, list[list[int]]]]:
    """Three trained versions: the adapter to publish and PEFT's greedy tokens for each prompt."""
    from transformers import AutoModelForCausalLM

    made = {}
    for version, seed in ((1, 101), (2, 202), (3, 303)):
        model = make_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), r=8, alpha=16, seed=seed, std=0.05)
        made[version] = (export(model), [_greedy(model, p) for p in PROMPTS])
    tokens = [t for _, t in made.values()]
    assert all(a != b for i, a in enumerate(tokens) for b in tokens[i + 1 :]), "versions must be told apart by their tokens"
    return made


@pytest.fixture
def direct(vllm_server: Any) -> Iterator[VLLMEngine]:
    """The real server, not through the proxy: what it really lists and serves."""
    engine = VLLMEngine(vllm_server.url, timeout=120)
    yield engine
    engine.close()


@pytest.fixture
def proxy(vllm_server: Any) -> Iterator[FaultProxy]:
    with FaultProxy(vllm_server.url) as p:
        yield p


@pytest.fixture
def name(direct: VLLMEngine) -> Iterator[str]:
    """A name of this test's own on the shared server; whatever it left loaded is unloaded."""
    ours = f"px-{uuid.uuid4().hex[:8]}"
    yield ours
    for served in direct.list_adapters():
        if served.startswith(ours + "@"):
            direct.unload_adapter(served)


def _publisher(proxy: FaultProxy, name: str, root: Path, transport: str, *, timeout: float = 60.0, attempts: int = 3) -> Publisher:
    engine = connect("vllm", proxy.url, timeout=timeout, retries=RetryPolicy(attempts=attempts, backoff=0.05, backoff_max=0.2))
    return Publisher([engine], name=name, keep=1, transport=transport, root=root)


def _listed(direct: VLLMEngine, name: str) -> list[str]:
    return sorted(n for n in direct.list_adapters() if n.startswith(name + "@"))


def _serves(direct: VLLMEngine, served: str) -> list[list[int]]:
    return [list(direct.generate(p, model=served, max_tokens=NEW_TOKENS, logprobs=None).token_ids) for p in PROMPTS]


def _assert_serves_exactly(direct: VLLMEngine, name: str, version: int, versions: dict) -> None:
    """The real server lists exactly ``name@v<version>`` of this name (keep=1) and it serves that
    version's trained tokens."""
    assert _listed(direct, name) == [f"{name}@v{version}"]
    assert _serves(direct, f"{name}@v{version}") == versions[version][1]


def _holds_exactly_or_nothing(direct: VLLMEngine, name: str, version: int, versions: dict) -> None:
    """After a publish that failed: a version the engine lists anyway (its load landed, its answer
    was lost) serves exactly that version's tokens, never other or zero weights."""
    served = f"{name}@v{version}"
    source = direct.adapter_sources().get(served, "absent")
    if source == "absent":
        return
    assert _serves(direct, served) == versions[version][1]
    if source is not None and source.startswith(IPC_PREFIX):
        # vLLM rebuilds an evicted adapter from what its path names: for a tensor load, the
        # tensors staged in the workers under that token. Released, the name would serve nothing.
        staged = httpx.post(f"{direct.url}/collective_rpc", json={"method": "lorasync_staged", "args": []}, timeout=60)
        assert staged.status_code == 200, staged.text
        token = source[len(IPC_PREFIX) :]
        assert all(token in tokens for tokens in staged.json()["results"]), f"{served} is listed but its staged tensors were released"


def _publish_v1(pub: Publisher, direct: VLLMEngine, name: str, versions: dict) -> None:
    report = pub.publish(versions[1][0], version=1).settled()
    assert report.ok and report.results[0].status == "loaded", report
    _assert_serves_exactly(direct, name, 1, versions)


def _loaded_or_failed_clean(report: Any, direct: VLLMEngine, name: str, version: int, versions: dict) -> None:
    """A publish that met a fault is either reported loaded and serves exactly that version, or
    failed with a typed error and left the previous version serving and nothing of this one."""
    result = report.results[0]
    if result.status == "loaded":
        _assert_serves_exactly(direct, name, version, versions)
        return
    assert result.status == "failed" and isinstance(result.error, EngineError), report
    assert _listed(direct, name) == [f"{name}@v{version - 1}"], (report, "a failed publish left a registration behind")
    assert _serves(direct, f"{name}@v{version - 1}") == versions[version - 1][1]


# -- 1. an empty 200 to the load ------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["disk", "ipc"])
def test_empty_200_to_a_load_that_landed(transport: str, versions: dict, direct: VLLMEngine, proxy: FaultProxy, name: str, tmp_path: Path) -> None:
    pub = _publisher(proxy, name, tmp_path / "store", transport)
    try:
        _publish_v1(pub, direct, name, versions)
        proxy.arm(LOAD, "empty200")
        report = pub.publish(versions[2][0], version=2).settled()
        assert [h.status for h in proxy.faulted(LOAD)] == [200]  # the engine really loaded it
        _loaded_or_failed_clean(report, direct, name, 2, versions)
        again = pub.publish(versions[3][0], version=3).settled()
        assert again.ok and again.results[0].status == "loaded", again
        _assert_serves_exactly(direct, name, 3, versions)
    finally:
        pub.close()


# -- 2. the answer dropped after the load landed ---------------------------------------------------


@pytest.mark.parametrize("transport", ["disk", "ipc"])
@pytest.mark.parametrize("drops", [1, -1], ids=["once", "every-attempt"])
def test_dropped_answer_after_the_load_landed(transport: str, drops: int, versions: dict, direct: VLLMEngine, proxy: FaultProxy, name: str, tmp_path: Path) -> None:
    pub = _publisher(proxy, name, tmp_path / "store", transport)
    try:
        _publish_v1(pub, direct, name, versions)
        proxy.arm(LOAD, "drop", times=drops)
        report = pub.publish(versions[2][0], version=2).settled()
        proxy.disarm()
        assert proxy.faulted(LOAD) and proxy.faulted(LOAD)[0].status == 200  # the first attempt landed
        if drops == 1:
            # The client's retry is answered "already loaded": its own earlier attempt, recognised.
            assert report.ok and report.results[0].status == "loaded", report
            _assert_serves_exactly(direct, name, 2, versions)
            return
        assert report.results[0].status == "failed" and isinstance(report.results[0].error, EngineUnavailableError), report
        assert _serves(direct, f"{name}@v1") == versions[1][1]  # the previous version keeps serving
        _holds_exactly_or_nothing(direct, name, 2, versions)
        # The same version again: recognised or loaded, never refused as stale.
        again = pub.publish(versions[2][0], version=2).settled()
        assert again.ok and again.results[0].status in ("loaded", "unchanged"), again
        assert again.served_name == f"{name}@v2"
        _assert_serves_exactly(direct, name, 2, versions)  # keep=1: v1 retired once v2 is reported served
        nxt = pub.publish(versions[3][0], version=3).settled()
        assert nxt.ok and nxt.results[0].status == "loaded", nxt
        _assert_serves_exactly(direct, name, 3, versions)
    finally:
        pub.close()


# -- 3. an engine restart as the client sees it: connections refused ------------------------------


def test_connections_refused_during_a_publish(versions: dict, direct: VLLMEngine, proxy: FaultProxy, name: str, tmp_path: Path) -> None:
    pub = _publisher(proxy, name, tmp_path / "store", "disk")
    try:
        _publish_v1(pub, direct, name, versions)
        proxy.down()
        report = pub.publish(versions[2][0], version=2).settled()
        result = report.results[0]
        assert result.status == "failed" and isinstance(result.error, EngineUnavailableError), report
        _assert_serves_exactly(direct, name, 1, versions)  # the previous version keeps serving
        proxy.up()
        again = pub.publish(versions[2][0], version=2).settled()
        assert again.ok and again.results[0].status == "loaded", again
        _assert_serves_exactly(direct, name, 2, versions)
    finally:
        pub.close()


@pytest.mark.parametrize("transport", ["disk", "ipc"])
def test_refused_right_after_the_load_landed(transport: str, versions: dict, direct: VLLMEngine, proxy: FaultProxy, name: str, tmp_path: Path) -> None:
    pub = _publisher(proxy, name, tmp_path / "store", transport)
    try:
        _publish_v1(pub, direct, name, versions)
        proxy.arm(LOAD, "drop_down")
        report = pub.publish(versions[2][0], version=2).settled()
        assert [h.status for h in proxy.faulted(LOAD)] == [200]
        result = report.results[0]
        assert result.status == "failed" and isinstance(result.error, EngineUnavailableError), report
        assert _serves(direct, f"{name}@v1") == versions[1][1]  # the previous version keeps serving
        _holds_exactly_or_nothing(direct, name, 2, versions)
        proxy.up()
        again = pub.publish(versions[2][0], version=2).settled()
        assert again.ok and again.results[0].status in ("loaded", "unchanged"), again
        assert again.served_name == f"{name}@v2"
        _assert_serves_exactly(direct, name, 2, versions)  # keep=1: v1 retired once v2 is reported served
        nxt = pub.publish(versions[3][0], version=3).settled()
        assert nxt.ok and nxt.results[0].status == "loaded", nxt
        _assert_serves_exactly(direct, name, 3, versions)
    finally:
        pub.close()


# -- 4. an answer slower than the client's timeout -------------------------------------------------


def test_load_answer_past_the_timeout(versions: dict, direct: VLLMEngine, proxy: FaultProxy, name: str, tmp_path: Path) -> None:
    pub = _publisher(proxy, name, tmp_path / "store", "disk", timeout=8.0, attempts=2)
    try:
        _publish_v1(pub, direct, name, versions)
        proxy.arm(LOAD, "slow", times=-1, delay=12.0)
        report = pub.publish(versions[2][0], version=2).settled()
        proxy.disarm()
        result = report.results[0]
        assert result.status == "failed" and isinstance(result.error, EngineTimeoutError), report
        assert _serves(direct, f"{name}@v1") == versions[1][1]  # the previous version keeps serving
        _holds_exactly_or_nothing(direct, name, 2, versions)
        again = pub.publish(versions[2][0], version=2).settled()
        assert again.ok and again.results[0].status in ("loaded", "unchanged"), again
        assert again.served_name == f"{name}@v2"
        _assert_serves_exactly(direct, name, 2, versions)  # keep=1: v1 retired once v2 is reported served
        nxt = pub.publish(versions[3][0], version=3).settled()
        assert nxt.ok and nxt.results[0].status == "loaded", nxt
        _assert_serves_exactly(direct, name, 3, versions)
    finally:
        pub.close()
