"""Engines joining and leaving a running fleet, against in-process PEFT engines with 3 slots:
what each served name serves is read from the engine's parameters and compared exactly with the
trainer's tensors at the version it names, and its greedy tokens with PEFT's own forward."""

from __future__ import annotations

import asyncio
import warnings

import pytest

from lorasync import Fleet, RetentionWarning
from lorasync.errors import CapacityError, ConfigError, EngineUnavailableError
from lorasync.exporters.fsdp import export
from tests.fleet.test_fleet_peft import adapters, check_serves, same
from tests.reliability._trust import served_lora as served
from tests.reliability._trust import state, step

from .conftest import CountingEngine


@pytest.fixture
def other(tiny_model_dir):
    """A second PEFT engine with 3 slots (a rollout node joining the run)."""
    e = CountingEngine(base_model_path=tiny_model_dir, max_loras=3)
    e.loads = []
    yield e
    e.close()


def test_an_added_engine_gets_every_current_version_then_steps_with_the_others(trainer, engine, other, tmp_path):
    models = {name: trainer(seed=s) for name, s in (("a", 1), ("b", 2), ("c", 3))}
    with Fleet([engine], root=tmp_path, transport="disk") as fleet:
        tenants = {name: fleet.register(name, keep=1, grace=0.0) for name in models}
        for version in (1, 2, 3):
            for i, model in enumerate(models.values()):
                step(model, seed=10 * version + i)
            fleet.publish(adapters(models), versions=dict.fromkeys(models, version)).raise_for_errors()
        published = {name: state(m) for name, m in models.items()}
        for model in models.values():
            step(model, seed=99)  # the trainers moved on: the new engine must get v3, not their tensors now
        engine.loads.clear()

        report = fleet.add_engine(other)
        assert sorted(report.restored) == ["a", "b", "c"] and report.ok
        for name in models:
            t = report[name]
            assert (t.status, t.version, t.served_name, t.restored_on) == ("restored", 3, f"{name}@v3", ["peft at " + other.url])
            assert same(served(other, f"{name}@v3"), published[name])
            assert sorted(r.status for r in t.results) == ["loaded", "unchanged"]  # the first engine moved nothing
        assert engine.loads == [] and sorted(other.loads) == ["a@v3", "b@v3", "c@v3"]
        assert {n: t.version for n, t in tenants.items()} == dict.fromkeys(models, 3)  # versions not bumped
        assert fleet.engines == [engine, other]

        # Every tenant's publisher manages the new engine now: loads, retention (keep=1), reports.
        for version in (4, 5, 6):
            for i, model in enumerate(models.values()):
                step(model, seed=100 * version + i)
            report = fleet.publish(adapters(models), versions=dict.fromkeys(models, version))
            assert report.ok, report
            for name, model in models.items():
                assert [r.status for r in report[name].results] == ["loaded", "loaded"]
                for e in (engine, other):
                    check_serves(e, f"{name}@v{version}", model)
            for e in (engine, other):
                assert sorted(e.list_adapters()) == [f"a@v{version}", f"b@v{version}", f"c@v{version}"]
        engine.loads.clear()
        other.loads.clear()
        step(models["b"], seed=7)
        report = fleet.publish(adapters(models), versions=dict.fromkeys(models, 7))
        assert (engine.loads, other.loads) == (["b@v7"], ["b@v7"])  # one load per engine for one changed tenant
        assert report["a"].status == "unchanged" and fleet.tenants["a"].version == 6

        # Retiring a tenant unloads it on the new engine too.
        assert fleet.retire("c") == ["c@v6", "c@v6"]
        assert sorted(other.list_adapters()) == ["a@v6", "b@v7"]

        # Remove the first engine: its versions go, their files stay (the other engine serves them).
        run = {name: tmp_path / name / tenants[name].registration for name in ("a", "b")}
        assert sorted(fleet.remove_engine(engine)) == ["a@v6", "b@v7"]
        assert engine.list_adapters() == [] and fleet.engines == [other]
        assert (run["a"] / "v6").is_dir() and (run["b"] / "v7").is_dir()
        step(models["a"], seed=8)
        report = fleet.publish(adapters({"a": models["a"]}), versions={"a": 8})
        assert [r.url for r in report["a"].results] == [other.url] and engine.list_adapters() == []
        check_serves(other, "a@v8", models["a"])

        # It comes back (an empty engine now): restored at the current versions, nothing bumped.
        report = fleet.add_engine(engine)
        assert {n: (t.status, t.version) for n, t in report.tenants.items()} == {"a": ("restored", 8), "b": ("restored", 7)}
        check_serves(engine, "a@v8", models["a"])
        check_serves(engine, "b@v7", models["b"])
    # A second run on the same engines: the new fleet starts from what the first one left.
    for e in (engine, other):
        for name in e.list_adapters():
            e.unload_adapter(name)
    with Fleet([other], root=tmp_path) as fleet:
        fleet.register("a", keep=1)
        fleet.publish(adapters({"a": models["a"]}), versions={"a": 1}).raise_for_errors()
        assert fleet.add_engine(engine)["a"].restored_on == ["peft at " + engine.url]
        check_serves(engine, "a@v1", models["a"])


def test_an_engine_too_small_for_the_current_versions_is_refused_before_anything_loads(trainer, engine, tiny_model_dir, tmp_path):
    small = CountingEngine(base_model_path=tiny_model_dir, max_loras=2)
    small.loads = []
    models = {name: trainer(seed=s) for name, s in (("a", 1), ("b", 2), ("c", 3))}
    try:
        with Fleet([engine], root=tmp_path) as fleet:
            for name in models:
                fleet.register(name, keep=1, grace=0.0)
            fleet.publish(adapters(models), versions=dict.fromkeys(models, 1)).raise_for_errors()
            with pytest.raises(CapacityError) as caught:
                fleet.add_engine(small)
            message = str(caught.value)
            assert "2 adapter slots" in message and all(f"{n}@v1 (to load)" in message for n in "abc"), message
            assert "was not added and nothing was loaded" in message and "fleet.retire(name)" in message
            assert caught.value.context["tenants"] == ("a", "b", "c")
            assert small.loads == [] and small.list_adapters() == [] and fleet.engines == [engine]
            step(models["a"], seed=5)
            report = fleet.publish(adapters(models), versions=dict.fromkeys(models, 2))
            assert len(report["a"].results) == 1  # the refused engine is no part of the fleet
            fleet.retire("c")
            report = fleet.add_engine(small)
            assert sorted(report.restored) == ["a", "b"] and sorted(small.list_adapters()) == ["a@v2", "b@v1"]
            check_serves(small, "a@v2", models["a"])
    finally:
        small.close()


def test_bad_engine_changes_are_typed_errors_that_say_what_to_do(trainer, engine, other, tmp_path):
    model = trainer(seed=1)
    with Fleet([engine], root=tmp_path) as fleet:
        fleet.register("a", keep=1)
        fleet.publish(adapters({"a": model}), versions={"a": 1}).raise_for_errors()
        with pytest.raises(ConfigError, match="more than once"):
            fleet.add_engine(engine)
        other.load_adapter_tensors("a@v9", export(trainer(seed=4), copy=True))  # another job's a
        with pytest.raises(ConfigError, match=r"already serves a@v9.*unload them"):
            fleet.add_engine(other)
        assert fleet.engines == [engine] and other.loads == ["a@v9"]
        with pytest.raises(ConfigError, match="only engine.*add its replacement first"):
            fleet.remove_engine(engine)
        with pytest.raises(ConfigError, match="not one of this fleet's engines"):
            fleet.remove_engine(other)
        with pytest.raises(ConfigError, match="not one of this fleet's engines"):
            fleet.remove_engine("vllm:http://127.0.0.1:1")
        with pytest.raises(EngineUnavailableError):
            fleet.add_engine("vllm:http://127.0.0.1:1")  # nothing listens: not added, its connection closed
        assert fleet.engines == [engine]
        with pytest.raises(ConfigError, match="unload must be True or False"):
            fleet.remove_engine(engine, unload="yes")  # type: ignore[arg-type]
        assert engine.list_adapters() == ["a@v1"]


def test_removing_an_engine_waits_for_leases_and_a_dead_one_is_dropped_without_asking_it(trainer, engine, other, tmp_path, monkeypatch):
    models = {"a": trainer(seed=1), "b": trainer(seed=2)}
    with Fleet([engine, other], root=tmp_path, transport="disk") as fleet:
        tenants = {n: fleet.register(n, keep=1, grace=0.0) for n in models}
        fleet.publish(adapters(models), versions={"a": 1, "b": 1}).raise_for_errors()
        with tenants["a"].lease(1):  # rollouts still run on a@v1: removal waits, then unloads anyway
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert sorted(fleet.remove_engine(other, timeout=0.3)) == ["a@v1", "b@v1"]
        assert any(issubclass(w.category, RetentionWarning) and "a@v1" in str(w.message) for w in caught)
        assert other.list_adapters() == [] and fleet.engines == [engine]

        fleet.add_engine(other)

        def gone(*_args, **_kwargs):
            raise EngineUnavailableError("peft at (in-process) is gone (the node died)")

        monkeypatch.setattr(other, "list_adapters", gone)
        monkeypatch.setattr(other, "adapter_sources", gone)
        with pytest.raises(EngineUnavailableError):
            fleet.remove_engine(other)
        assert fleet.engines == [engine, other]  # still in: call again, or without unloading
        assert fleet.remove_engine(other, unload=False) == [] and fleet.engines == [engine]
        run = tmp_path / "a" / tenants["a"].registration
        assert (run / "v1").is_dir()  # the remaining engine still serves it
        step(models["a"], seed=3)
        report = fleet.publish(adapters(models), versions={"a": 2, "b": 2})
        assert report.ok and [r.url for r in report["a"].results] == [engine.url]
        check_serves(engine, "a@v2", models["a"])


def test_async_add_and_remove(trainer, engine, other, tmp_path):
    models = {"x": trainer(seed=1), "y": trainer(seed=2)}

    async def main():
        async with Fleet([engine], root=tmp_path) as fleet:
            for name in models:
                await fleet.aregister(name, keep=1)
            (await fleet.apublish(adapters(models), versions={"x": 1, "y": 1})).raise_for_errors()
            with pytest.raises(Exception, match="await fleet.aadd_engine"):
                fleet.add_engine(other)  # blocking on the loop the fleet uses
            report = await fleet.aadd_engine(other)
            assert sorted(report.restored) == ["x", "y"]
            assert sorted(await fleet.aremove_engine(engine)) == ["x@v1", "y@v1"]

    asyncio.run(main())
    check_serves(other, "x@v1", models["x"])
    assert engine.list_adapters() == []


def test_an_added_engine_is_verified_with_each_tenants_probe(trainer, engine, other, tmp_path):
    from lorasync import Probe
    from lorasync.errors import VerificationError

    from .test_fleet_peft import PROMPT

    models = {"a": trainer(seed=1), "b": trainer(seed=2)}
    right = {n: Probe.from_model(m, PROMPT, max_tokens=4) for n, m in models.items()}
    wrong = Probe.from_model(trainer(seed=77), PROMPT, max_tokens=4)  # another model's tokens
    with Fleet([engine], root=tmp_path) as fleet:
        fleet.register("a", keep=1, verify=right["a"])
        fleet.register("b", keep=1, verify=wrong)  # b's default probe cannot pass
        fleet.publish(adapters(models), versions={"a": 1, "b": 1}, verify={"b": right["b"]}).raise_for_errors()
        # b@v1 passed the round's probe, not b's default: that probe is what checks it on the new
        # engine (a restore is verified with the probe its version was published with).
        fleet.tenants["b"]._probe = wrong  # as if b@v1 had been verified with a probe the engine cannot reproduce
        report = fleet.add_engine(other)
        added = {n: report[n].results[1] for n in models}  # results follow fleet.engines (both PEFT engines share a url)
        assert report["a"].status == "restored" and "verified through the engine" in added["a"].reason
        assert report["b"].status == "failed" and isinstance(report["b"].error, VerificationError)  # b alone
        assert isinstance(added["b"].error, VerificationError) and report["b"].version == 1
        assert other.list_adapters() == ["a@v1"] and fleet.engines == [engine, other]
        check_serves(other, "a@v1", models["a"])
        check_serves(engine, "b@v1", models["b"])  # b still serves where it was
        fleet.tenants["b"]._probe = right["b"]
        again = fleet.restore()  # the probe b@v1 passed: it passes on the new engine too
        assert again["b"].status == "restored" and "verified through the engine" in again["b"].results[1].reason
        check_serves(other, "b@v1", models["b"])
