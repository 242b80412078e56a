"""Publishing through vLLM's own router (vllm-router, the real Rust binary from PyPI) in front of two
real vLLM CPU servers, as a team with a serving fleet does: the trainer knows the router's URL.

* the plain ``vllm`` client refuses the router's URL (a load there would reach one worker);
* ``vllm-router:URL`` publishes to every worker, with a result per worker, verified on each;
* requests sent through the router, round robin, reach every worker and all of them answer with
  the published version, exact against PEFT, also for requests in flight across a publish;
* a worker that restarts gets the current version back at the next publish, and the router's
  requests to it are exact again.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from lorasync import Probe, Publisher
from lorasync.engines import connect
from lorasync.engines.vllm.router import VLLMRouter
from lorasync.errors import CapabilityError, ReplicatedEngineError
from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model, make_tiny_model
from lorasync.testing.vllm_router import VLLMRouterProcess
from lorasync.testing.vllm_server import VLLMServer, free_port, start_all

from tests.support.greedy import peft_greedy as reference

pytestmark = pytest.mark.vllm

PROMPTS = ([5, 17, 99, 230, 41], [300, 12, 7], [64, 65, 66, 67, 68, 69])
EXTENSION = ("--worker-extension-cls", "lorasync.engines.vllm_worker.LoraSyncWorkerExtension")


@pytest.fixture(scope="module")
def workers(vllm_python: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VLLMServer]]:
    logs = tmp_path_factory.mktemp("vllm-router-logs")
    servers = [
        VLLMServer(tiny_model_dir, python=vllm_python, port=free_port(), served_model_name="tiny-base", extra_args=EXTENSION, log_path=logs / f"worker{i}.log")
        for i in range(2)
    ]
    try:
        start_all(servers)
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def router(workers: list[VLLMServer], tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMRouterProcess]:
    log = tmp_path_factory.mktemp("vllm-router-logs") / "router.log"
    with VLLMRouterProcess([w.url for w in workers], log_path=log) as process:
        yield process


def trained(seed: int) -> torch.nn.Module:
    return make_peft_model(make_tiny_model(), r=8, seed=seed)


def through_router(router: VLLMRouterProcess, model: str, prompt: list[int], n: int = 6) -> list[int]:
    """One completion as a user sends it: to the router, by the served name."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    response = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, (model, response.status_code, response.text[:300])
    return list(response.json()["choices"][0]["token_ids"])


def answered(server: VLLMServer) -> float:
    """Requests this worker finished (vLLM's own counter): which worker the router picked."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def every_worker_serves(router: VLLMRouterProcess, workers: list[VLLMServer], model: str, expected: dict[int, list[int]]) -> None:
    """Send requests through the router until every worker answered some, each exact."""
    before = [answered(w) for w in workers]
    for _ in range(4):
        for i, prompt in enumerate(PROMPTS):
            assert through_router(router, model, list(prompt)) == expected[i], (model, prompt)
        if all(answered(w) > b for w, b in zip(workers, before)):
            return
    raise AssertionError(f"the router never sent {model} requests to every worker: {[answered(w) - b for w, b in zip(workers, before)]}")


def unload_everything(workers: list[VLLMServer]) -> None:
    """Leave the shared workers as the next test expects them: serving no adapter."""
    for worker in workers:
        with connect("vllm", worker.url) as engine:
            for name in engine.list_adapters():
                engine.unload_adapter(name)


def test_the_plain_client_refuses_a_router_url(router: VLLMRouterProcess) -> None:
    with connect("vllm", router.url) as engine, pytest.raises(ReplicatedEngineError, match="vllm-router:") as caught:
        engine.capabilities()
    assert "2 server(s)" in str(caught.value)


def test_a_second_router_on_the_host_starts_and_publishes(router: VLLMRouterProcess, workers: list[VLLMServer], tmp_path: Path) -> None:
    # vllm-router's metrics exporter binds port 29000 unless told otherwise: a second router on
    # one host (one per replica set, as the replicas benchmark runs them) panicked at start.
    with VLLMRouterProcess([w.url for w in workers[:1]], log_path=tmp_path / "second-router.log") as second:
        model = trained(seed=41)
        pub = Publisher([f"vllm-router:{second.url}"], name="second-router", keep=1, root=tmp_path / "pub")
        try:
            report = pub.publish(export(model), version=1).raise_for_errors()
            assert len(report.results) == 1, report.results  # the one worker it lists
            assert through_router(second, report.served_name, list(PROMPTS[0])) == reference(model, list(PROMPTS[0]))
        finally:
            pub.close()
            unload_everything(workers)


def test_a_url_without_workers_is_not_a_router(workers: list[VLLMServer]) -> None:
    group = VLLMRouter(workers[0].url)
    with pytest.raises(CapabilityError, match="not a vllm-router"):
        group.members()


def test_every_worker_serves_each_version_through_the_router(router: VLLMRouterProcess, workers: list[VLLMServer], tmp_path: Path) -> None:
    pub = Publisher([f"vllm-router:{router.url}"], name="routed", keep=2, root=tmp_path)
    try:
        assert sorted(e.url for e in pub.engines) == sorted(w.url for w in workers)
        models = {}
        for version in (1, 2):
            models[version] = trained(seed=40 + version)
            probe = Probe.from_model(models[version], list(PROMPTS[0]), max_tokens=4, atol=1e-3)
            if version == 2:
                # Requests for v1 keep going through the router while v2 is published.
                stop, seen, failures = threading.Event(), [], []

                def rollouts() -> None:
                    want = reference(models[1], list(PROMPTS[1]))
                    while not stop.is_set():
                        try:
                            seen.append(through_router(router, "routed@v1", list(PROMPTS[1])) == want)
                        except AssertionError as exc:
                            failures.append(exc)

                thread = threading.Thread(target=rollouts)
                thread.start()
                while not seen and not failures and thread.is_alive():
                    time.sleep(0.05)  # rollouts are running when the publish starts
            try:
                report = pub.publish(export(models[version]), version=version, verify=probe)
            finally:
                if version == 2:
                    stop.set()
                    thread.join()
            assert report.ok, report
            assert sorted(r.url for r in report.results) == sorted(w.url for w in workers)
            assert all(r.status == "loaded" and "verified" in r.reason for r in report.results), report
            assert report.served_name == f"routed@v{version}"
            every_worker_serves(router, workers, report.served_name, {i: reference(models[version], list(p)) for i, p in enumerate(PROMPTS)})
        assert failures == [] and seen and all(seen), (failures, seen)
        # v1 stays (keep=2) and is exact on every worker, too.
        every_worker_serves(router, workers, "routed@v1", {i: reference(models[1], list(p)) for i, p in enumerate(PROMPTS)})
    finally:
        pub.close()
        unload_everything(workers)


def test_a_restarted_worker_gets_the_current_version_back(router: VLLMRouterProcess, workers: list[VLLMServer], tmp_path: Path) -> None:
    pub = Publisher(connect("vllm-router", router.url), name="restarts", keep=1, root=tmp_path)
    try:
        model = trained(seed=51)
        adapter = export(model)
        assert pub.publish(adapter, version=3).ok
        workers[1].stop()
        workers[1].start()  # same port: the router sends it requests again once healthy
        probe = Probe.from_model(model, list(PROMPTS[0]), max_tokens=4, atol=1e-3)
        report = pub.publish(adapter, version=3, verify=probe)
        assert report.ok, report
        status = {r.url: r.status for r in report.results}
        assert status == {workers[0].url: "unchanged", workers[1].url: "loaded"}, report
        every_worker_serves(router, workers, "restarts@v3", {i: reference(model, list(p)) for i, p in enumerate(PROMPTS)})
    finally:
        pub.close()
        unload_everything(workers)
