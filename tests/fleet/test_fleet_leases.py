"""Rollouts lease ``tenant.version`` while rounds run: the version they read must never be one on
its way out. Checked at the exact moments it matters, on PEFT engines that record them: when the
previous version is unloaded, ``tenant.version`` already names its successor; and on an engine
that rebuilds adapters from their files (as vLLM does), a tenant's serving version stays listed
until its successor loads, even with every slot taken."""

from __future__ import annotations

import dataclasses

import pytest

from lorasync import Fleet
from tests.fleet.test_fleet_peft import adapters, check_serves
from tests.reliability._trust import step

from .conftest import CountingEngine


class Watching(CountingEngine):
    """Records, at each unload, the version the fleet's tenant names then; at each load, what the
    engine listed. ``soft``: reports 3 slots that it rebuilds from files (vLLM's LRU), while
    holding up to 6."""

    fleet: Fleet | None = None
    soft = False

    def capabilities(self):
        caps = super().capabilities()
        return dataclasses.replace(caps, max_loras=3, reloads_from_path=True) if self.soft else caps

    def unload_adapter(self, name):
        tenant = self.fleet.tenants.get(name.split("@")[0]) if self.fleet is not None else None
        self.unloads.append((name, tenant.version if tenant is not None else None))
        super().unload_adapter(name)

    def load_adapter_tensors(self, name, adapter):
        self.listed_at_load.append((name, sorted(self.list_adapters())))
        super().load_adapter_tensors(name, adapter)


@pytest.fixture
def watching(tiny_model_dir):
    def make(*, soft: bool) -> Watching:
        e = Watching(base_model_path=tiny_model_dir, max_loras=6 if soft else 3)
        e.loads, e.unloads, e.listed_at_load, e.soft = [], [], [], soft
        return e

    return make


@pytest.mark.parametrize("soft", [False, True], ids=["slots", "rebuilds-from-files"])
def test_tenant_version_names_the_successor_before_the_previous_version_goes(trainer, watching, tmp_path, soft):
    engine = watching(soft=soft)
    models = {name: trainer(seed=s) for name, s in (("a", 1), ("b", 2), ("c", 3))}
    try:
        with Fleet([engine], root=tmp_path) as fleet:
            engine.fleet = fleet
            for name in models:
                fleet.register(name, keep=1, grace=0.0)
            fleet.publish(adapters(models), versions=dict.fromkeys(models, 1)).raise_for_errors()
            for version in (2, 3, 4):
                for i, model in enumerate(models.values()):
                    step(model, seed=10 * version + i)
                engine.unloads.clear()
                engine.listed_at_load.clear()
                fleet.publish(adapters(models), versions=dict.fromkeys(models, version)).raise_for_errors()
                assert sorted(engine.list_adapters()) == [f"{n}@v{version}" for n in "abc"]
                if soft:
                    # Every tenant's serving version was still listed when its successor loaded,
                    # and retired only afterwards, once tenant.version named the successor.
                    for name, listed in engine.listed_at_load:
                        assert f"{name.split('@')[0]}@v{version - 1}" in listed, (name, listed)
                    assert sorted(engine.unloads) == [(f"{n}@v{version - 1}", version) for n in "abc"]
                else:
                    # 3 hard slots held by 3 current versions: each previous version leaves before
                    # its successor loads (the documented cost of a full budget).
                    assert sorted(engine.unloads) == [(f"{n}@v{version - 1}", version - 1) for n in "abc"]
            for name, model in models.items():
                check_serves(engine, f"{name}@v4", model)
    finally:
        engine.close()


def test_lease_without_a_version_pins_the_current_one_even_when_a_round_moves_it_meanwhile(tmp_path):
    """``tenant.lease(tenant.version)`` reads the version, then pins it: a round in between may
    already be retiring it. ``tenant.lease()`` pins first and checks after."""
    from lorasync.errors import ConfigError, PublisherClosedError
    from lorasync.testing import MemoryEngine
    from lorasync.testing._conformance import tiny_llama_adapter

    engine = MemoryEngine()
    with Fleet([engine], root=tmp_path) as fleet:
        tenant = fleet.register("a", keep=2, grace=0.0)
        with pytest.raises(ConfigError, match="no version yet"):
            with tenant.lease():
                pass
        for version in (1, 2):
            fleet.publish({"a": tiny_llama_adapter(seed=version)}, versions={"a": version}).raise_for_errors()
        with tenant.lease() as name:
            assert name == "a@v2" and tenant.publisher.pinned == {2}
        real_hold, moved = tenant._hold, []

        def hold(version):  # a round's _serves lands right after this pin (the lease's pin: Tenant._hold)
            held = real_hold(version)
            if not moved:
                moved.append(version)
                tenant.version = 3
            return held

        tenant._hold = hold
        with tenant.lease() as name:
            assert moved == [2] and name == "a@v3" and tenant.publisher.pinned == {3}
        assert tenant.publisher.pinned == frozenset()
        del tenant._hold
        tenant.version = 2
        fleet.retire("a")
        with pytest.raises(PublisherClosedError):
            with tenant.lease():
                pass
    engine.close()
