"""Regressions from the third adversarial pass over issue 28's fixes (each failed before its fix).

* a cancelled in-place ``apublish`` whose verification would fail left those weights serving;
* one ``optimizer.step()`` that raised made every later publish fail as "torn";
* ``lease(version)`` yielded a name no engine served (in place; an "unchanged" version);
* concurrent ``publish_adapter`` calls with the same explicit ``run=`` refused each other;
* ``DistributedPublisher`` took a float ``src``, ``is_leader="no"`` and any object as a probe;
* ``alpha_pattern`` took ``inf`` (served with ``report.ok``), ``use_rslora`` took ``"false"``;
* ``root=""`` made the working directory the store; ``base=5`` ended in a bare ``TypeError``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
import torch

from lorasync import Adapter, Probe, Publisher, apublish_adapter, publish_adapter
from lorasync.engines.peft import PeftEngine
from lorasync.errors import AdapterNotFoundError, ConfigError
from lorasync.exporters.fsdp import export

from ._trust import PROMPT, lora_params, same, served_lora, state, step, trainer

BOUND_S = 120.0


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lorasync.testing import make_tiny_model

    path = tmp_path_factory.mktemp("third-pass") / "base"
    make_tiny_model(path)
    return path


# -- a cancelled in-place publish with a probe --------------------------------------------------------


@pytest.mark.parametrize("turns", [0, 4, 12, 16, 20, 28, 36, 60])
def test_a_cancelled_in_place_verification_never_leaves_unverified_weights(base: Path, tmp_path: Path, turns: int) -> None:
    model = trainer(base)
    engine = PeftEngine(base_model_path=base)
    never = Probe(prompt_ids=tuple(PROMPT), expected_ids=(1, 1))  # no engine passes it

    async def scenario() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        async with Publisher(engine, name="p", root=tmp_path, in_place=True) as pub:
            first = await pub.apublish(export(model), version=1, verify=Probe.from_model(model, PROMPT, max_tokens=2))
            assert first.ok, first
            v1 = state(model)
            step(model, seed=7, scale=0.5)
            task = asyncio.ensure_future(pub.apublish(export(model), version=2, verify=never))
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            try:
                report = await task
                assert not report.ok  # finished before the cancel: the failed verification put v1 back
            except asyncio.CancelledError:
                pass
            await asyncio.sleep(0.2)  # an engine call a cancel cannot stop has ended by now
            return v1, state(model), served_lora(engine, "p")

    v1, v2, served = asyncio.run(asyncio.wait_for(scenario(), BOUND_S))
    assert not same(served, v2), "weights that failed (or never passed) verification serve as 'p'"
    assert same(served, v1), "'p' does not serve the previous, verified version"


# -- an optimizer step that raised ---------------------------------------------------------------------


def test_a_step_that_raised_does_not_make_later_publishes_torn(base: Path, tmp_path: Path) -> None:
    model = trainer(base)
    optimizer = torch.optim.AdamW(lora_params(model), lr=1e-3)
    engine = PeftEngine(base_model_path=base)
    with Publisher(engine, name="p", root=tmp_path) as pub:
        assert pub.publish(export(model), version=1).ok

        def out_of_memory() -> None:
            raise RuntimeError("CUDA out of memory (inside optimizer.step)")

        with pytest.raises(RuntimeError, match="out of memory"):
            optimizer.step(out_of_memory)  # the loop catches it and publishes what it has
        for version in (2, 3):
            step(model, seed=version)
            report = pub.publish(export(model), version=version)
            assert report.ok, report
            assert same(served_lora(engine, report.served_name), state(model))


def test_a_step_running_in_another_thread_is_still_seen(base: Path, tmp_path: Path) -> None:
    # The guard of the fix: a step that is really running (not one that raised) still tears.
    model = trainer(base)
    optimizer = torch.optim.AdamW(lora_params(model), lr=1e-3)
    engine = PeftEngine(base_model_path=base)
    inside, leave = threading.Event(), threading.Event()

    def slow_step() -> float:
        inside.set()
        leave.wait(BOUND_S)
        return 0.0

    for p in lora_params(model):
        p.grad = torch.zeros_like(p)
    stepping = threading.Thread(target=optimizer.step, args=(slow_step,))
    stepping.start()
    try:
        assert inside.wait(BOUND_S)
        with Publisher(engine, name="p", root=tmp_path, transport="ipc") as pub:
            report = pub.publish(export(model), version=1)
            assert not report.ok and "AdamW" in str(report.results[0].error), report
    finally:
        leave.set()
        stepping.join(BOUND_S)


# -- lease -------------------------------------------------------------------------------------------------


def test_lease_yields_the_name_that_serves_the_version(base: Path, tmp_path: Path) -> None:
    model = trainer(base)
    engine = PeftEngine(base_model_path=base)
    with Publisher(engine, name="p", root=tmp_path / "a", in_place=True) as pub:
        pub.publish(export(model), version=1)
        with pub.lease(1) as served:
            assert served == "p" and engine.generate(PROMPT, adapter=served, max_new_tokens=2)
    with Publisher(engine, name="q", root=tmp_path / "b") as pub:
        assert pub.publish(export(model), version=1).ok
        again = pub.publish(export(model), version=2).settled()
        assert again.results[0].status == "unchanged" and again.served_name == "q@v1"
        with pub.lease(2) as served:
            assert served == "q@v1"
            assert pub.pinned == frozenset({1})  # the version that serves it is the one kept
            assert engine.generate(PROMPT, adapter=served, max_new_tokens=2)

        async def leased() -> str:
            async with pub.alease(2) as name:
                return name

        assert asyncio.run(leased()) == "q@v1"
        with pytest.raises(AdapterNotFoundError):
            engine.generate(PROMPT, adapter="q@v2", max_new_tokens=2)


# -- stateless calls with run= ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_concurrent_stateless_calls_with_one_explicit_run_take_turns(base: Path, tmp_path: Path, mode: str) -> None:
    model = trainer(base)
    adapter = Adapter(state(model), export(model).config)
    engines = [PeftEngine(base_model_path=base) for _ in range(4)]
    failures: list[BaseException] = []

    def calls(i: int) -> None:
        try:
            for version in range(1, 4):
                if mode == "sync":
                    report = publish_adapter(adapter, engines[i], name="p", version=version, root=tmp_path, run="exp42", transport="disk")
                else:
                    report = asyncio.run(apublish_adapter(adapter, engines[i], name="p", version=version, root=tmp_path, run="exp42", transport="disk"))
                report.raise_for_errors()
        except BaseException as exc:  # noqa: BLE001 - counted below
            failures.append(exc)

    threads = [threading.Thread(target=calls, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND_S)
    assert not failures, failures[:2]
    assert all(engine.list_adapters() for engine in engines)


# -- option validation --------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{"src": 0.0}, {"is_leader": "no"}, {"verify": 1}, {"timeout": 5}])
def test_distributed_publisher_options_are_checked_at_construction(options: dict, tmp_path: Path) -> None:
    import torch.distributed as dist

    from lorasync.distributed import DistributedPublisher
    from lorasync.testing.vllm_server import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match=next(iter(options))):
            DistributedPublisher(name="p", engines=[], root=tmp_path, **options)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"alpha_pattern": {"q_proj": float("inf")}}, "alpha_pattern"),
        ({"use_rslora": "false"}, "use_rslora"),
        ({"base_model_name_or_path": ["x"]}, "base_model_name_or_path"),
    ],
)
def test_an_adapter_config_lorasync_cannot_scale_exactly_is_refused(base: Path, tmp_path: Path, change: dict, fragment: str) -> None:
    folder = export(trainer(base)).save(tmp_path / "a")
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(change)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=fragment):
        Adapter.load(folder)


def test_an_empty_root_is_refused_not_the_working_directory(base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="root is empty"):
        Publisher(PeftEngine(base_model_path=base), name="p", root="")
    with pytest.raises(ConfigError, match="root must be a folder path"):
        Publisher(PeftEngine(base_model_path=base), name="p", root=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="base must be"):
        Publisher(PeftEngine(base_model_path=base), name="p", root=tmp_path / "s", transport="merged", base=5)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
