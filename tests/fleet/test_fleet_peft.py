"""The fleet against the in-process PEFT engine (3 adapter slots): what each served name serves is
read from the engine's own parameters and compared exactly with the trainer's tensors, and its
greedy tokens with PEFT's own forward of the trainer model."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from lorasync import Fleet, Probe
from lorasync.errors import AdapterError, CapacityError, ConfigError, ExportError, PublisherClosedError, VerificationError
from lorasync.exporters.fsdp import export
from tests.reliability._trust import served_lora as served
from tests.reliability._trust import state, step

PROMPT = [5, 17, 99, 230, 41]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return bool(a) and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def greedy(model, n: int = 4) -> list[int]:
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


def adapters(models: dict) -> dict:
    return {name: export(m, copy=True) for name, m in models.items()}


def check_serves(engine, name: str, model) -> None:
    """``name`` serves exactly the trainer's tensors, and the tokens PEFT computes from them."""
    assert same(served(engine, name), state(model)), f"{name} does not serve the trainer's tensors"
    assert engine.generate(PROMPT, adapter=name, max_new_tokens=4) == greedy(model)


@pytest.fixture
def three(trainer, engine, tmp_path):
    models = {name: trainer(seed=s) for name, s in (("a", 1), ("b", 2), ("c", 3))}
    fleet = Fleet([engine], root=tmp_path)
    for name in models:
        fleet.register(name, keep=2, grace=0.0)
    report = fleet.publish(adapters(models), versions=dict.fromkeys(models, 1))
    assert report.ok and all(t.status == "loaded" for t in report.tenants.values())
    yield fleet, models
    fleet.close()


def test_three_tenants_ten_steps_then_one_changed_is_one_load(three, engine):
    fleet, models = three
    for version in range(2, 11):
        for i, model in enumerate(models.values()):
            step(model, seed=100 * version + i)
        report = fleet.publish(adapters(models), versions=dict.fromkeys(models, version))
        assert report.ok, report
        for name, model in models.items():
            assert report[name].status == "loaded" and report[name].served_name == f"{name}@v{version}"
            check_serves(engine, f"{name}@v{version}", model)
        # 3 slots, 3 current versions: every window is trimmed to fit (keep=2 asks for 6).
        assert sorted(engine.list_adapters()) == [f"a@v{version}", f"b@v{version}", f"c@v{version}"]
    engine.loads.clear()
    step(models["b"], seed=7)
    report = fleet.publish(adapters(models), versions=dict.fromkeys(models, 11))
    assert engine.loads == ["b@v11"]
    assert (report["a"].status, report["a"].version, report["a"].served_name) == ("unchanged", 10, "a@v10")
    assert (report["c"].status, report["c"].version) == ("unchanged", 10)
    assert report["a"].results == [] and report["b"].status == "loaded"
    assert fleet.tenants["a"].version == 10 and fleet.tenants["b"].version == 11
    assert sorted(engine.list_adapters()) == ["a@v10", "b@v11", "c@v10"]
    check_serves(engine, "b@v11", models["b"])


def test_fourth_tenant_is_refused_before_anything_is_unloaded(three, engine, trainer):
    fleet, models = three
    before = {n: served(engine, n) for n in engine.list_adapters()}
    with pytest.raises(CapacityError) as caught:
        fleet.register("d")
    message = str(caught.value)
    assert "3 adapter slots" in message and all(f"{n}@v1" in message for n in "abc") and "Nothing was unloaded" in message
    assert caught.value.context["tenants"] == ("a", "b", "c", "d")
    assert all(same(before[n], served(engine, n)) for n in before)
    assert sorted(engine.list_adapters()) == ["a@v1", "b@v1", "c@v1"] and "d" not in fleet.tenants


def test_a_lease_that_does_not_fit_refuses_the_round_before_anything_moves(three, engine):
    fleet, models = three
    with fleet.tenants["a"].lease(1):  # rollouts still run on a@v1: it must stay beside a@v2
        step(models["a"], seed=5)
        with pytest.raises(CapacityError, match="pinned or with requests a@v1"):
            fleet.publish(adapters(models), versions=dict.fromkeys(models, 2))
        assert sorted(engine.list_adapters()) == ["a@v1", "b@v1", "c@v1"] and sorted(engine.loads) == ["a@v1", "b@v1", "c@v1"]  # nothing more was loaded
    report = fleet.publish(adapters(models), versions=dict.fromkeys(models, 2))
    assert report["a"].status == "loaded" and report["b"].status == "unchanged"
    check_serves(engine, "a@v2", models["a"])


def test_retire_frees_slots_and_files_then_a_fourth_tenant_serves(trainer, engine, tmp_path):
    models = {name: trainer(seed=s) for name, s in (("a", 1), ("b", 2), ("c", 3))}
    with Fleet([engine], root=tmp_path, transport="disk") as fleet:
        for name in models:
            fleet.register(name, keep=1, grace=0.0)
        fleet.publish(adapters(models), versions=dict.fromkeys(models, 4)).raise_for_errors()
        run = tmp_path / "b" / fleet.tenants["b"].registration
        assert (run / "v4" / ".holders.json").is_file()  # the registration names the run holding its files and holders
        assert fleet.retire("b") == ["b@v4"]
        assert sorted(engine.list_adapters()) == ["a@v4", "c@v4"] and not (run / "v4").exists()
        d = trainer(seed=9)
        fleet.register("d", keep=1, grace=0.0)
        report = fleet.publish({"d": export(d, copy=True)}, versions={"d": 1})
        assert report["d"].status == "loaded"
        check_serves(engine, "d@v1", d)
        check_serves(engine, "a@v4", models["a"])
        with pytest.raises(ConfigError, match="no tenant 'b'"):
            fleet.publish({"b": export(models["b"], copy=True)}, versions={"b": 5})


def test_reregistration_is_fenced_from_the_old_one(trainer, engine, tmp_path):
    model = trainer(seed=1)
    with Fleet([engine], root=tmp_path) as fleet:
        old = fleet.register("a", grace=0.0)
        content = export(model, copy=True)
        first = fleet.publish({"a": content}, versions={"a": 5})
        assert first["a"].registration == old.registration and engine.list_adapters() == ["a@v5"]
        fleet.retire("a")
        assert engine.list_adapters() == [] and old.retired
        with pytest.raises(PublisherClosedError, match="retired"):
            old.pin(5)
        new = fleet.register("a", grace=0.0)
        assert new.registration != old.registration and new.version is None
        engine.loads.clear()
        # The stale-hash path: identical content (same hash) at a lower version than the old
        # registration served. Nothing of the old one is recalled: it loads, as v1.
        report = fleet.publish({"a": export(model, copy=True)}, versions={"a": 1})
        assert report["a"].status == "loaded" and report["a"].registration == new.registration
        assert report["a"].served_name == "a@v1" and report["a"].publish.bytes_moved > 0
        assert report["a"].results[0].status == "loaded" and engine.loads == ["a@v1"]
        assert engine.list_adapters() == ["a@v1"]
        check_serves(engine, "a@v1", model)


def test_register_refuses_a_name_the_engine_still_serves(trainer, engine, tmp_path):
    engine.load_adapter_tensors("a@v3", export(trainer(seed=4), copy=True))  # another job's
    with Fleet([engine], root=tmp_path) as fleet:
        with pytest.raises(ConfigError, match="still serves a@v3"):
            fleet.register("a")
        assert "a" not in fleet.tenants and engine.list_adapters() == ["a@v3"]


def test_engine_restart_restores_every_current_version_unchanged(three, engine):
    fleet, models = three
    published = {name: state(m) for name, m in models.items()}
    for model in models.values():
        step(model, seed=11)  # the trainers moved on: a restore must load v1, not their tensors now
    for name in engine.list_adapters():  # a restart, as a client sees it: every adapter gone
        engine.unload_adapter(name)
    report = fleet.restore()
    assert sorted(report.restored) == ["a", "b", "c"]
    for name in models:
        t = report[name]
        assert (t.status, t.version, t.served_name, t.restored_on) == ("restored", 1, f"{name}@v1", ["peft at " + engine.url])
        assert same(served(engine, f"{name}@v1"), published[name])
    assert fleet.tenants["a"].version == 1
    # Next round after another restart: the tenant that stepped loads its new version, the others
    # are restored at their versions.
    for name in engine.list_adapters():
        engine.unload_adapter(name)
    report = fleet.publish({"a": export(models["a"], copy=True)}, versions={"a": 2})
    assert report["a"].status == "loaded" and report["a"].version == 2
    assert report["b"].status == "restored" and report["c"].version == 1
    assert sorted(engine.list_adapters()) == ["a@v2", "b@v1", "c@v1"]
    check_serves(engine, "a@v2", models["a"])
    assert same(served(engine, "b@v1"), published["b"])


def test_a_failing_tenant_fails_alone(three, engine, trainer):
    fleet, models = three
    for i, model in enumerate(models.values()):
        step(model, seed=40 + i)
    bad = torch.nn.Linear(4, 4)  # no LoRA in it: nothing to export
    wrong = Probe.from_model(trainer(seed=77), PROMPT, max_tokens=4)  # another model's tokens
    report = fleet.publish(
        {"a": export(models["a"], copy=True), "b": bad, "c": export(models["c"], copy=True)},
        versions=dict.fromkeys(models, 2),
        verify={"a": wrong},
    )
    assert report["b"].status == "failed" and isinstance(report["b"].error, (AdapterError, ExportError))
    assert report["a"].status == "failed" and isinstance(report["a"].error, VerificationError)
    assert report["c"].status == "loaded"
    check_serves(engine, "c@v2", models["c"])
    assert "a@v2" not in engine.list_adapters() and "b@v1" in engine.list_adapters()
    assert fleet.tenants["a"].version == 1 and fleet.tenants["b"].version == 1
    with pytest.raises(ExportError, match="no LoRA weights"):
        report.raise_for_errors()  # the first failure, typed


def test_async_fleet(trainer, engine, tmp_path):
    models = {"x": trainer(seed=1), "y": trainer(seed=2)}

    async def main():
        async with Fleet([engine], root=tmp_path) as fleet:
            for name in models:
                await fleet.aregister(name, keep=1)
            report = await fleet.apublish(adapters(models), versions={"x": 1, "y": 1})
            assert report.ok
            with pytest.raises(Exception, match="await fleet"):
                fleet.publish(adapters(models), versions={"x": 2, "y": 2})  # blocking on the loop the fleet uses
            step(models["y"], seed=3)
            report = await fleet.apublish(adapters(models), versions={"x": 2, "y": 2})
            assert (report["x"].status, report["y"].status) == ("unchanged", "loaded")
            assert await fleet.aretire("x") == ["x@v1"]

    asyncio.run(main())
    check_serves(engine, "y@v2", models["y"])
    assert engine.list_adapters() == ["y@v2"]


def test_bad_registrations_fail_at_register(engine, tmp_path):
    with Fleet([engine], root=tmp_path) as fleet:
        with pytest.raises(ConfigError, match="keep"):
            fleet.register("a", keep=0)
        fleet.register("a")
        with pytest.raises(ConfigError, match="registered already"):
            fleet.register("a")
        with pytest.raises(ConfigError, match="no version for tenant"):
            fleet.publish({"a": {}}, versions={})
    assert os.path.isdir(tmp_path)


def test_retire_waits_for_a_running_lease_and_refuses_new_ones(trainer, engine, tmp_path):
    import threading
    import time

    model = trainer(seed=1)
    with Fleet([engine], root=tmp_path) as fleet:
        tenant = fleet.register("a", grace=0.0)
        fleet.publish({"a": export(model, copy=True)}, versions={"a": 1})
        tenant.pin(1)  # a rollout batch still runs on a@v1
        threading.Timer(0.5, tenant.unpin, args=(1,)).start()
        start = time.monotonic()
        assert fleet.retire("a") == ["a@v1"]
        assert time.monotonic() - start >= 0.45 and engine.list_adapters() == []
        with pytest.raises(PublisherClosedError):
            tenant.pin(1)


def test_a_retirement_waiting_for_requests_does_not_stall_the_other_tenants(trainer, engine, tmp_path):
    import concurrent.futures
    import time

    models = {"a": trainer(seed=1), "b": trainer(seed=2)}
    with Fleet([engine], root=tmp_path) as fleet:
        tenants = {n: fleet.register(n, keep=1, grace=0.0) for n in models}
        fleet.publish(adapters(models), versions={"a": 1, "b": 1})
        tenants["a"].pin(1)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            retiring = pool.submit(fleet.retire, "a")
            time.sleep(0.2)
            step(models["b"], seed=8)
            report = fleet.publish({"b": export(models["b"], copy=True)}, versions={"b": 2})  # goes on meanwhile
            assert report["b"].status == "loaded" and not retiring.done()
            with pytest.raises(ConfigError, match="retiring"):
                fleet.publish({"a": export(models["a"], copy=True)}, versions={"a": 2})
            tenants["a"].unpin(1)
            assert retiring.result(timeout=60) == ["a@v1"]
        assert engine.list_adapters() == ["b@v2"]
        check_serves(engine, "b@v2", models["b"])


def test_only_the_engine_that_restarted_is_restored(trainer, engine, tiny_model_dir, tmp_path):
    from .conftest import CountingEngine

    other = CountingEngine(base_model_path=tiny_model_dir, max_loras=3)
    other.loads = []
    models = {"a": trainer(seed=1), "b": trainer(seed=2)}
    with Fleet([engine, other], root=tmp_path) as fleet:
        for name in models:
            fleet.register(name, keep=1)
        fleet.publish(adapters(models), versions={"a": 3, "b": 5}).raise_for_errors()
        for name in other.list_adapters():
            other.unload_adapter(name)
        engine.loads.clear()
        report = fleet.restore()
        assert {n: (t.status, t.version, t.restored_on) for n, t in report.tenants.items()} == {
            "a": ("restored", 3, ["peft at " + other.url]),
            "b": ("restored", 5, ["peft at " + other.url]),
        }
        assert engine.loads == [] and sorted(r.status for r in report["a"].results) == ["loaded", "unchanged"]
        for e in (engine, other):
            check_serves(e, "a@v3", models["a"])
            check_serves(e, "b@v5", models["b"])
        assert fleet.restore().tenants == {}  # nothing lost: nothing to do


def test_a_tenant_whose_step_failed_is_still_restored_and_reported_failed(three, engine):
    fleet, models = three
    for name in engine.list_adapters():
        engine.unload_adapter(name)
    report = fleet.publish({"a": torch.nn.Linear(4, 4)}, versions={"a": 2})
    assert report["a"].status == "failed" and isinstance(report["a"].error, ExportError)
    assert report["a"].restored_on == ["peft at " + engine.url] and report["a"].version == 1 and not report.ok
    assert sorted(report.restored) == ["a", "b", "c"] and sorted(engine.list_adapters()) == ["a@v1", "b@v1", "c@v1"]
    check_serves(engine, "b@v1", models["b"])
