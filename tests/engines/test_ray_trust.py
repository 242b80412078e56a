"""Trust of the Ray engine (issue 28, items 38-41) against a real local Ray cluster (``ray.init(num_cpus=2)``).

Actors host the PEFT engine, as in ``test_ray_engine.py``: what a user sees is what is asserted —
object-store bytes against the adapter's size, publishing across ``ray.shutdown()``/``ray.init()``,
a load that outlives its timeout, and an actor whose constructor failed.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from lorasync import Adapter, Probe, Publisher  # noqa: E402
from lorasync.engines import connect  # noqa: E402
from lorasync.engines import ray_actor  # noqa: E402
from lorasync.engines.ray_actor import EngineHost, RayEngine  # noqa: E402
from lorasync.errors import EngineTimeoutError, EngineUnavailableError  # noqa: E402
from lorasync.exporters.fsdp import export  # noqa: E402
from lorasync.testing import make_peft_model, make_tiny_model  # noqa: E402

PROMPT = [5, 6, 7, 8]


def _init() -> None:
    ray.init(num_cpus=2, object_store_memory=128 * 1024**2, include_dashboard=False, log_to_driver=False, configure_logging=False)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    if ray.is_initialized():  # a cluster left by earlier code of this process
        ray.shutdown()
    _init()
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the slow engine's factory below
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    ray.shutdown()


def _host(tiny_model_dir: Path, **options: Any) -> Any:
    return ray.remote(num_cpus=0.5)(EngineHost).options(**options).remote("peft", base_model_path=str(tiny_model_dir), max_rank=16)


def _tokens(model: Any) -> list[int]:
    return list(Probe.from_model(model, PROMPT, max_tokens=6).expected_ids)


def test_an_adapter_read_from_disk_enters_the_object_store_once(cluster: None, tiny_model_dir: Path, tmp_path: Path) -> None:
    model = make_peft_model(make_tiny_model(), r=8, seed=3)
    adapter = Adapter.load(export(model).save(tmp_path / "adapter"))  # tensors: views of one buffer
    assert len(adapter.tensors) == 28
    ref = ray_actor._put_once(adapter)
    stored = ray.experimental.get_object_locations([ref])[ref]["object_size"]
    assert stored < adapter.nbytes * 1.05 + 64 * 1024, (stored, adapter.nbytes)  # once, not once per tensor
    engine = connect("ray", actor=_host(tiny_model_dir))
    engine.load_adapter_tensors("compact@v1", adapter)  # the actor gets an Adapter back from the store
    assert engine.greedy("compact@v1", PROMPT, 6)[0] == _tokens(model)
    engine.unload_adapter("compact@v1")


def _slow_first_load(base: str, delay: float) -> Any:
    """A PEFT engine whose first tensor load takes ``delay`` seconds (a busy engine)."""
    engine = connect("peft", base_model_path=base, max_rank=16)
    load, calls = engine.load_adapter_tensors, []

    def slow(name: str, adapter: Any) -> None:
        if not calls:
            time.sleep(delay)
        calls.append(name)
        load(name, adapter)

    engine.load_adapter_tensors = slow  # type: ignore[method-assign]
    return engine


def test_a_load_that_timed_out_is_not_served_and_publishing_it_again_loads_it(cluster: None, tiny_model_dir: Path, tmp_path: Path) -> None:
    actor = ray.remote(num_cpus=0.5)(EngineHost).remote(factory=functools.partial(_slow_first_load, str(tiny_model_dir), 6.0))
    ray.get(actor.lorasync_node.remote(), timeout=300)  # started (its PEFT model loaded)
    engine = RayEngine(actor=actor, timeout=4.0)
    model = make_peft_model(make_tiny_model(), r=8, seed=9)
    with Publisher(engine, name="slow", root=tmp_path / "store") as publisher:
        report = publisher.publish(export(model), version=1)
        assert isinstance(report.results[0].error, EngineTimeoutError), report.results[0]
        # The load went on in the actor; the report says it failed, so it must not be served. While
        # it still runs (a loaded box: the actor's load can outlast the second timeout too), every
        # call is refused typed, naming the load, and nothing is sent; once it ends it is taken back.
        deadline = time.monotonic() + 120
        while True:
            try:
                served = engine.list_adapters()
                break
            except EngineTimeoutError as exc:
                assert "still running" in str(exc) and "slow@v1" in str(exc), exc
                assert time.monotonic() < deadline, "the timed-out load never ended in the actor"
        assert served == []
        retry = publisher.publish(export(model), version=1).settled()  # the natural retry
        assert retry.results[0].status == "loaded", retry.results[0]
        assert engine.greedy("slow@v1", PROMPT, 6)[0] == _tokens(model)
    engine.unload_adapter("slow@v1")


def test_an_actor_whose_constructor_failed_reports_why(cluster: None, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    engine = connect("ray", actor=ray.remote(num_cpus=0.5)(EngineHost).remote("peft", base_model_path=str(missing)))
    with pytest.raises(EngineUnavailableError) as info:
        engine.list_adapters()
    text = str(info.value)
    assert "ConfigError" in text and str(missing) in text and "constructor" in text, text
    assert "restart the actor" not in text.lower()
    report = Publisher(engine, name="never", root=tmp_path / "store").publish(export(make_peft_model(make_tiny_model(), r=8)), version=1)
    assert str(missing) in str(report.results[0].error)


def test_publishing_the_same_adapter_after_ray_restarts_puts_it_again(cluster: None, tiny_model_dir: Path, tmp_path: Path) -> None:
    # Last in the module: it replaces the module's cluster with a new one (the fixture shuts it down).
    model = make_peft_model(make_tiny_model(), r=8, seed=4)
    adapter = export(model)
    for session in (1, 2):
        if session == 2:
            ray.shutdown()  # the trainer restarts Ray (a new job, or ray.init after a failure)
            _init()
        engine = connect("ray", actor=_host(tiny_model_dir))
        with Publisher(engine, name="again", root=tmp_path / f"store{session}") as publisher:
            report = publisher.publish(adapter, version=1).settled()
            assert report.results[0].status == "loaded", (session, report.results[0])
            assert engine.greedy("again@v1", PROMPT, 6)[0] == _tokens(model)
