"""The fleet over Ray actors (a real local Ray cluster on 2 CPUs), each hosting the PEFT engine with
3 slots: tenants step together for several rounds with every load verified through the actor, one
changed tenant moves one adapter per actor, a retirement frees its slots, an actor that Ray
restarted gets every current version back at unchanged versions, and an actor leaves and joins.
Tokens are PEFT's own greedy tokens of the trainer at the version each served name says."""

from __future__ import annotations

import time
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from lorasync import Fleet, Probe  # noqa: E402
from lorasync.engines import connect  # noqa: E402
from lorasync.errors import CapacityError, EngineUnavailableError  # noqa: E402
from lorasync.exporters.fsdp import export  # noqa: E402
from tests.engines.test_ray_engine import cluster  # noqa: E402,F401 - the local Ray cluster fixture
from tests.reliability._trust import step  # noqa: E402

PROMPT = [5, 6, 7, 8]
TOKENS = 6


def probes(models: dict[str, Any]) -> dict[str, Probe]:
    """PEFT's greedy tokens of each trainer now; checked through every actor after each load."""
    return {name: Probe.from_model(m, PROMPT, max_tokens=TOKENS) for name, m in models.items()}


def tokens(engine: Any, served: str) -> list[int]:
    return engine.greedy(served, PROMPT, TOKENS)[0]


def fresh(engine: Any) -> None:
    """Wait until the actor Ray restarts answers, with every adapter gone (``ray.kill`` is asynchronous)."""
    deadline, seen = time.monotonic() + 120, []
    while not seen or seen[-1] != []:
        assert time.monotonic() < deadline, f"the actor did not come back fresh: {seen[-5:]}"
        try:
            seen.append(engine.list_adapters())
        except EngineUnavailableError as exc:
            seen.append(type(exc).__name__)
        time.sleep(0.2)


def test_fleet_over_ray_actors(cluster, trainer, tiny_model_dir, tmp_path):  # noqa: F811
    hosts = [_host_with_slots(tiny_model_dir, restarts=1), _host_with_slots(tiny_model_dir, restarts=0)]
    engines = [connect("ray", actor=h) for h in hosts]
    models = {name: trainer(seed=s) for name, s in (("a", 1), ("b", 2), ("c", 3))}
    expected: dict[str, list[int]] = {}
    with Fleet(engines, root=tmp_path) as fleet:
        for name in models:
            fleet.register(name, keep=1, grace=0.0)
        for version in range(1, 5):
            for i, model in enumerate(models.values()):
                step(model, seed=10 * version + i)
            checks = probes(models)
            report = fleet.publish({n: export(m, copy=True) for n, m in models.items()}, versions=dict.fromkeys(models, version), verify=checks)
            assert report.ok, report
            for name in models:
                assert [(r.status, r.transport) for r in report[name].results] == [("loaded", "ipc")] * 2
                assert all("verified through the engine" in r.reason for r in report[name].results)
                expected[f"{name}@v{version}"] = list(checks[name].expected_ids)
            for e in engines:
                assert sorted(e.list_adapters()) == [f"a@v{version}", f"b@v{version}", f"c@v{version}"]
                assert all(tokens(e, f"{n}@v{version}") == expected[f"{n}@v{version}"] for n in models)
        # Only what stepped is sent: one tenant changed, one load per actor.
        step(models["b"], seed=99)
        checks = probes({"b": models["b"]})
        report = fleet.publish({n: export(m, copy=True) for n, m in models.items()}, versions=dict.fromkeys(models, 5), verify=checks)
        assert [report[n].status for n in "abc"] == ["unchanged", "loaded", "unchanged"]
        assert report["a"].results == [] and [r.status for r in report["b"].results] == ["loaded", "loaded"]
        expected["b@v5"] = list(checks["b"].expected_ids)
        with pytest.raises(CapacityError, match="3 adapter slots"):
            fleet.register("d")
        assert fleet.retire("c") == ["c@v4", "c@v4"]
        d = trainer(seed=4)
        fleet.register("d", keep=1)
        checks = probes({"d": d})
        fleet.publish({"d": export(d, copy=True)}, versions={"d": 1}, verify=checks).raise_for_errors()
        expected["d@v1"] = list(checks["d"].expected_ids)

        # Ray restarts the first actor: it forgot every adapter; the fleet restores them there only.
        for model in models.values():
            step(model, seed=123)  # the trainers moved on: the restore loads the fleet's copies
        ray.kill(hosts[0], no_restart=False)
        fresh(engines[0])
        restored = fleet.restore()
        assert {n: (t.status, t.version, t.restored_on) for n, t in restored.tenants.items()} == {
            "a": ("restored", 4, [f"ray at {engines[0].url}"]),
            "b": ("restored", 5, [f"ray at {engines[0].url}"]),
            "d": ("restored", 1, [f"ray at {engines[0].url}"]),
        }
        for e in engines:
            assert sorted(e.list_adapters()) == ["a@v4", "b@v5", "d@v1"]
            assert all(tokens(e, n) == expected[n] for n in ("a@v4", "b@v5", "d@v1"))

        # The second actor leaves (its versions unloaded) and joins again (restored).
        assert sorted(fleet.remove_engine(engines[1])) == ["a@v4", "b@v5", "d@v1"]
        assert engines[1].list_adapters() == []
        report = fleet.add_engine(engines[1])
        assert sorted(report.restored) == ["a", "b", "d"] and {t.version for t in report.tenants.values()} == {4, 5, 1}
        assert all(tokens(engines[1], n) == expected[n] for n in ("a@v4", "b@v5", "d@v1"))
    for e in engines:
        for name in e.list_adapters():
            e.unload_adapter(name)
        e.close()
    for h in hosts:
        ray.kill(h, no_restart=True)


def _host_with_slots(tiny_model_dir: Any, *, restarts: int) -> Any:
    """An actor hosting the PEFT engine with 3 adapter slots."""
    from lorasync.engines.ray_actor import EngineHost

    actor_cls = ray.remote(num_cpus=0.5)(EngineHost)
    return actor_cls.options(max_restarts=restarts).remote("peft", base_model_path=str(tiny_model_dir), max_rank=16, max_loras=3)
