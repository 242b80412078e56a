"""The Ray engine against a real local Ray cluster (``ray.init(num_cpus=2)``): actors hosting the
PEFT engine, driven through ``connect("ray", actor=handle)``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from lorasync import Probe, Publisher  # noqa: E402
from lorasync.engines import connect  # noqa: E402
from lorasync.engines import ray_actor  # noqa: E402
from lorasync.engines.ray_actor import EngineHost, RayEngine  # noqa: E402
from lorasync.errors import AdapterNotFoundError, ConfigError, EngineUnavailableError, RankTooLargeError  # noqa: E402
from lorasync.exporters.fsdp import export  # noqa: E402
from lorasync.testing import EngineConformance, make_peft_model, make_tiny_model  # noqa: E402

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    if ray.is_initialized():  # a cluster left by earlier code of this process (a docs block)
        ray.shutdown()
    ray.init(
        num_cpus=2,
        object_store_memory=128 * 1024**2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    yield
    ray.shutdown()


def _host(tiny_model_dir: Path, **options: Any) -> Any:
    actor_cls = ray.remote(num_cpus=0.5)(EngineHost)
    return actor_cls.options(**options).remote("peft", base_model_path=str(tiny_model_dir), max_rank=16)


@pytest.fixture(scope="module")
def host(cluster: None, tiny_model_dir: Path) -> Any:
    return _host(tiny_model_dir, max_restarts=1)


@pytest.fixture(scope="module")
def engine(host: Any) -> RayEngine:
    made = connect("ray", actor=host)
    assert isinstance(made, RayEngine)
    return made


def _versions() -> list[Any]:
    return [make_peft_model(make_tiny_model(), r=8, seed=seed, std=0.05) for seed in (1, 7, 11)]


def test_capabilities_are_the_hosted_engines_seen_through_ray(engine: RayEngine) -> None:
    caps = engine.capabilities()
    assert (caps.engine, caps.url, caps.max_rank, caps.tensor_load) == ("ray", engine.url, 16, True)
    assert caps.in_process and caps.same_host  # one-node cluster: the actor shares this host
    assert any("hosted engine: peft" in n for n in caps.notes)


def test_publish_verify_retire_through_the_object_store(engine: RayEngine, tmp_path: Path) -> None:
    models = _versions()
    with Publisher(engine, name="policy", keep=2, root=tmp_path / "store") as publisher:
        for version, model in enumerate(models, start=1):
            probe = Probe.from_model(model, PROMPT, max_tokens=6)
            report = publisher.publish(export(model), version=version, verify=probe).settled().raise_for_errors()
            (result,) = report.results
            assert (result.status, result.transport) == ("loaded", "ipc")
            assert "verified through the engine" in result.reason
            assert engine.greedy(report.served_name, PROMPT, 6)[0] == list(probe.expected_ids)
        assert engine.list_adapters() == ["policy@v2", "policy@v3"]
        assert result.retired == ["policy@v1"]
    with pytest.raises(AdapterNotFoundError):
        engine.unload_adapter("policy@v1")
    for name in engine.list_adapters():
        engine.unload_adapter(name)


def test_the_adapter_enters_the_object_store_once(cluster: None) -> None:
    adapter = export(_versions()[0])
    first, second = ray_actor._put_once(adapter), ray_actor._put_once(adapter)
    assert first is second  # every Ray engine of one publish shares one object
    back = ray.get(first)
    assert back.content_hash == adapter.content_hash
    other = export(_versions()[1])
    assert ray_actor._put_once(other) is not first


def test_typed_errors_come_back_typed(engine: RayEngine, tmp_path: Path) -> None:
    big = export(make_peft_model(make_tiny_model(), r=32, seed=3))
    with pytest.raises(RankTooLargeError) as info:
        engine.load_adapter_tensors("big@v1", big)  # raised inside the actor, pickled back
    assert (info.value.rank, info.value.max_rank) == (32, 16)
    with pytest.raises(AdapterNotFoundError):
        engine.unload_adapter("never-loaded@v1")
    with pytest.raises(ConfigError, match="lorasync_call"):
        connect("ray", actor=object())


def test_actor_restart_forgets_adapters_and_publishing_resumes(host: Any, engine: RayEngine, tmp_path: Path) -> None:
    models = _versions()
    with Publisher(engine, name="restart", keep=2, root=tmp_path / "store") as publisher:
        publisher.publish(export(models[0]), version=1).raise_for_errors()
        ray.kill(host, no_restart=False)  # the actor crashes; Ray restarts it (max_restarts=1)
        # ray.kill is asynchronous: calls may still reach the old actor, then fail while it
        # restarts (a typed EngineUnavailableError), then reach the fresh one, which lost every adapter.
        deadline, answers = time.monotonic() + 120, []
        while not answers or answers[-1] != []:
            assert time.monotonic() < deadline, f"the actor did not come back fresh: {answers[-5:]}"
            try:
                answers.append(engine.list_adapters())
            except EngineUnavailableError as exc:
                answers.append(type(exc).__name__)
            time.sleep(0.2)
        probe = Probe.from_model(models[1], PROMPT, max_tokens=6)
        report = publisher.publish(export(models[1]), version=2, verify=probe).settled().raise_for_errors()
        assert report.results[0].status == "loaded"
        assert engine.list_adapters() == ["restart@v2"]
    engine.unload_adapter("restart@v2")


def test_dead_actor_is_a_typed_error_and_the_others_keep_serving(
    engine: RayEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    doomed = connect("ray", actor=_host(tiny_model_dir))
    assert doomed.list_adapters() == []
    ray.kill(doomed.actor, no_restart=True)
    deadline = time.monotonic() + 60
    with pytest.raises(EngineUnavailableError, match="dead or restarting"):
        while time.monotonic() < deadline:  # ray.kill is asynchronous
            doomed.list_adapters()
            time.sleep(0.2)
    model = _versions()[2]
    with Publisher([engine, doomed], name="pair", root=tmp_path / "store") as publisher:
        report = publisher.publish(export(model), version=1)
    ok, dead = report.results
    assert ok.status == "loaded" and isinstance(dead.error, EngineUnavailableError)
    assert engine.greedy("pair@v1", PROMPT, 6)[0] == list(Probe.from_model(model, PROMPT, max_tokens=6).expected_ids)
    engine.unload_adapter("pair@v1")


class TestRayConformance(EngineConformance):
    @pytest.fixture
    def engine(self, engine: RayEngine) -> RayEngine:  # type: ignore[override]
        return engine
