"""The Fleet publishes through the Publisher's own parts (issue 33, items 1, 2, 6, 9, 10, 11):
the torn-read watch, verification before anything counts as served, typed refusals before
anything loads, registrations that give back what they took. Real peer: the in-process PEFT
engine; what it serves is read from its own parameters."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from lorasync import Fleet, Probe
from lorasync.engines.peft import PeftEngine
from lorasync.errors import AdapterChangedError, CapacityError, ConfigError, VerificationError
from lorasync.exporters.fsdp import export
from lorasync.transports._snapshot import OwnedAdapter
from tests.reliability._trust import content_hash, lora_params, optimizer_step, same, served_lora, state, step, trainer

PROMPT = [5, 17, 99, 230, 41]


# -- item 1: a round never serves a mix of two optimizer steps --------------------------------------


def test_a_step_landing_in_the_rounds_copy_is_refused_not_served(tiny_model_dir, tmp_path, monkeypatch):
    """The optimizer step lands between two tensors of the copy the round takes of a no-copy
    export (the engine takes tensors, so the round publishes an owned copy): the tenant fails with
    AdapterChangedError and its previous version serves on, as a plain Publisher does."""
    import lorasync.publisher._digest
    import lorasync.fleet._hash

    model = trainer(tiny_model_dir, seed=1)
    optimizer = torch.optim.AdamW(lora_params(model), lr=0.05, fused=True)
    engine = PeftEngine(base_model_path=tiny_model_dir)
    torn = []

    def tearing_copy(adapter):
        if isinstance(adapter, OwnedAdapter):
            return adapter
        out = {}
        for i, (key, tensor) in enumerate(adapter.tensors.items()):
            if i == 2 and not torn:
                torn.append(state(model))  # the trainer's next step lands here, in its own thread's time
                optimizer_step(optimizer, model, seed=7)
            out[key] = tensor.detach().clone()
        return OwnedAdapter(out, adapter.config)

    with Fleet([engine], root=tmp_path) as fleet:
        fleet.register("a", keep=2, grace=0.0)
        v1 = state(model)
        assert fleet.publish({"a": export(model)}, versions={"a": 1})["a"].status == "loaded"
        step(model, seed=3)
        before_tear = state(model)
        monkeypatch.setattr(lorasync.fleet._hash, "owned_copy", tearing_copy, raising=False)
        monkeypatch.setattr(lorasync.publisher._digest, "owned_copy", tearing_copy)
        report = fleet.publish({"a": export(model)}, versions={"a": 2})
        monkeypatch.undo()
        assert torn, "the step never landed in the round's copy"
        served_now = served_lora(engine, "a@v2")
        assert not served_now or same(served_now, before_tear) or same(served_now, state(model)), "a@v2 serves a mix of two steps"
        assert report["a"].status == "failed" and isinstance(report["a"].error, AdapterChangedError), report["a"]
        assert "a@v2" not in engine.list_adapters() and same(served_lora(engine, "a@v1"), v1)
        assert fleet.tenants["a"].version == 1
        # Between steps the next round serves exactly the trainer's weights.
        again = fleet.publish({"a": export(model)}, versions={"a": 3})
        assert again["a"].status == "loaded" and same(served_lora(engine, "a@v3"), state(model))
    engine.close()


@pytest.mark.parametrize("transport", [None, "disk"], ids=["tensors", "files"])
def test_rounds_beside_a_running_optimizer_serve_one_step_or_fail(tiny_model_dir, tmp_path, transport):
    """A trainer thread steps AdamW over the LoRA tensors continuously while rounds publish a
    no-copy export: every round reported loaded serves exactly the weights of one step, with the
    hash of exactly those weights. With files (the engine loads what the disk transport wrote)
    the round's unchanged check reads under no watch: the publish's own write pass does."""
    model = trainer(tiny_model_dir, seed=2)
    optimizer = torch.optim.AdamW(lora_params(model), lr=0.05, foreach=True)
    engine = PeftEngine(base_model_path=tiny_model_dir)
    seen = [state(model)]
    stop = threading.Event()

    def train():
        seed = 0
        while not stop.is_set():
            seed += 1
            optimizer_step(optimizer, model, seed=seed)
            seen.append(state(model))  # this thread's own step: nothing else writes the tensors
            time.sleep(0.0005)

    loaded = 0
    with Fleet([engine], root=tmp_path, **({"transport": transport} if transport else {})) as fleet:
        fleet.register("a", keep=1, grace=0.0)
        thread = threading.Thread(target=train, daemon=True)
        thread.start()
        try:
            for version in range(1, 13):
                report = fleet.publish({"a": export(model)}, versions={"a": version})
                tenant = report["a"]
                if tenant.status == "loaded":
                    loaded += 1
                    got = served_lora(engine, tenant.served_name)
                    assert any(same(got, s) for s in list(seen)), f"round {version}: {tenant.served_name} serves a mix of two optimizer steps"
                    assert tenant.publish.content_hash == content_hash(got, model)
                    assert tenant.publish.results[0].transport == (transport or "ipc"), tenant.publish.results[0]
                else:
                    assert tenant.status in ("failed", "unchanged"), tenant
                    if tenant.status == "failed":
                        assert isinstance(tenant.error, AdapterChangedError), tenant.error
        finally:
            stop.set()
            thread.join()
        # The trainer stopped: the next round serves exactly its weights (rounds beside a step
        # that fail are refusals, not a Fleet that can no longer publish).
        final = fleet.publish({"a": export(model)}, versions={"a": 13})["a"]
        assert final.status == "loaded" and same(served_lora(engine, final.served_name), state(model)), final
    engine.close()


# -- item 2: only a verified version is restored --------------------------------------------------


def _other_base(tiny_model_dir):
    """The tiny base with its weights moved: an engine over it cannot reproduce the trainer's probe."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in base.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return base


def test_a_version_that_failed_verification_is_never_restored_unverified(tiny_model_dir, tmp_path):
    model = trainer(tiny_model_dir, seed=4)
    good = PeftEngine(base_model_path=tiny_model_dir)
    other = PeftEngine(model=_other_base(tiny_model_dir))
    with Fleet([good, other], root=tmp_path) as fleet:
        fleet.register("a", keep=2, grace=0.0)
        assert fleet.publish({"a": export(model, copy=True)}, versions={"a": 1})["a"].ok
        step(model, seed=8)
        probe = Probe.from_model(model, PROMPT, max_tokens=4)
        report = fleet.publish({"a": export(model, copy=True)}, versions={"a": 2}, verify={"a": probe})  # per-round probe
        assert report["a"].status == "failed"
        assert "a@v2" in good.list_adapters() and "a@v2" not in other.list_adapters()
        # The next rounds find a@v2 missing on `other`: a restore must verify it there too.
        for again in (fleet.restore(), fleet.publish({"a": export(model, copy=True)}, versions={"a": 2})):
            tenant = again.tenants.get("a")
            assert tenant is not None and tenant.status == "failed", f"a@v2 reported {tenant and tenant.status} on an engine that fails its probe"
            assert isinstance(tenant.error, VerificationError), tenant.error
            assert "a@v2" not in other.list_adapters(), "a version that failed its probe serves"
    good.close()
    other.close()


def test_a_tenant_lease_refuses_a_version_that_failed_verification_as_the_publisher_does(tiny_model_dir, tmp_path):
    """Issue 33 ("lease refuses unverified versions") through the Fleet: tenant a's v2 fails its probe
    and is withdrawn, the engine keeps serving v1. tenant.lease(2) pinned it and yielded "a@v2", a
    name the engine does not serve (the rollouts failed against the engine, not at the lease)."""
    v1, v2 = trainer(tiny_model_dir, seed=1), trainer(tiny_model_dir, seed=2)
    good = Probe.from_model(v2, PROMPT, max_tokens=4)
    bad = Probe(good.prompt_ids, tuple((t + 1) % 500 + 4 for t in good.expected_ids))  # tokens v2 never produces
    engine = PeftEngine(base_model_path=tiny_model_dir)
    with Fleet([engine], root=tmp_path) as fleet:
        fleet.register("a")
        assert fleet.publish({"a": export(v1, copy=True)}, versions={"a": 1})["a"].ok
        report = fleet.publish({"a": export(v2, copy=True)}, versions={"a": 2}, verify={"a": bad})
        assert report["a"].status == "failed" and isinstance(report["a"].error, VerificationError)
        tenant = fleet.tenants["a"]
        assert engine.list_adapters() == ["a@v1"] and tenant.version == 1
        with pytest.raises(VerificationError, match="did not pass its verification"):
            with tenant.lease(2):
                pass
        assert 2 not in tenant.publisher.pinned  # nothing left pinned by the refused lease
        for lease in (tenant.lease(), tenant.lease(1)):  # what serves is leased as before
            with lease as name:
                assert name == "a@v1" and name in engine.list_adapters() and tenant.publisher.pinned == {1}
        # Published again and verified, v2 is leased.
        assert fleet.publish({"a": export(v2, copy=True)}, versions={"a": 2}, verify={"a": good})["a"].ok
        with tenant.lease(2) as name:
            assert name == "a@v2" and name in engine.list_adapters()
    engine.close()


# -- item 6: one Probe for the whole round ---------------------------------------------------------


def test_a_single_probe_for_a_round_is_refused_up_front_and_nothing_hangs(tiny_model_dir, tmp_path):
    models = {n: trainer(tiny_model_dir, seed=s) for n, s in (("a", 1), ("b", 2), ("c", 3), ("d", 4), ("e", 5))}
    engine = PeftEngine(base_model_path=tiny_model_dir)
    probe = Probe.from_model(models["a"], PROMPT, max_tokens=2)
    result: dict = {}

    def run():
        with Fleet([engine], root=tmp_path) as fleet:
            for n in models:
                fleet.register(n, grace=0.0)
            for few in (["a"], list(models)):
                try:
                    fleet.publish({n: export(models[n], copy=True) for n in few}, versions=dict.fromkeys(few, 1), verify=probe)
                    result.setdefault("returned", []).append(few)
                except ConfigError as exc:
                    result.setdefault("refused", []).append(str(exc))
            result["listed"] = engine.list_adapters()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the round or close() hangs"
    assert "returned" not in result, result
    assert len(result["refused"]) == 2 and all("verify={" in m for m in result["refused"]), result
    assert result["listed"] == []  # refused before anything was loaded
    engine.close()


# -- item 9: slots are booked at registration -----------------------------------------------------


def test_registering_more_tenants_than_slots_is_refused_at_register(tiny_model_dir, tmp_path):
    engine = PeftEngine(base_model_path=tiny_model_dir, max_loras=3)
    models = {n: trainer(tiny_model_dir, seed=s) for n, s in (("a", 1), ("b", 2), ("c", 3))}
    with Fleet([engine], root=tmp_path) as fleet:
        for n in models:
            fleet.register(n, keep=1, grace=0.0)
        with pytest.raises(CapacityError, match="3 adapter slots"):
            fleet.register("d")
        assert "d" not in fleet.tenants
        report = fleet.publish({n: export(m, copy=True) for n, m in models.items()}, versions=dict.fromkeys(models, 1))
        assert report.ok and sorted(engine.list_adapters()) == ["a@v1", "b@v1", "c@v1"]
        for n, m in models.items():
            assert same(served_lora(engine, f"{n}@v1"), state(m))
    engine.close()


# -- item 10: a registration gives back what it took ----------------------------------------------


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_register_retire_cycles_leave_descriptors_and_the_store_flat(tiny_model_dir, tmp_path):
    model = trainer(tiny_model_dir, seed=1)
    adapter = export(model, copy=True)
    engine = PeftEngine(base_model_path=tiny_model_dir)
    with Fleet([engine], root=tmp_path, transport="disk") as fleet:  # files, so every registration takes a run
        for _ in range(3):  # warm up: the loop thread, the name's folder
            fleet.register("a", grace=0.0)
            fleet.publish({"a": adapter}, versions={"a": 1})
            fleet.retire("a")
        fds, runs = _fds(), sorted(os.listdir(tmp_path / "a"))
        for i in range(200):
            fleet.register("a", grace=0.0)
            if i % 20 == 0:
                assert fleet.publish({"a": adapter}, versions={"a": 1})["a"].status == "loaded"
            fleet.retire("a")
        assert _fds() <= fds + 2, f"{_fds() - fds} descriptors leaked over 200 register/retire cycles"
        assert sorted(os.listdir(tmp_path / "a")) == runs == [], "retired registrations left run folders in the store"
        assert engine.list_adapters() == []
    engine.close()


# -- item 11: typed refusals before anything loads ------------------------------------------------


def test_public_entries_refuse_bad_arguments_with_typed_errors_before_anything_loads(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="engine"):
        Fleet(None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="engine"):
        Fleet([None])  # type: ignore[list-item]
    model = trainer(tiny_model_dir, seed=1)
    engine = PeftEngine(base_model_path=tiny_model_dir)
    with Fleet([engine], root=tmp_path) as fleet:
        fleet.register("a", grace=0.0)
        fleet.register("b", grace=0.0)
        good = {"a": export(model, copy=True)}
        for bad in (None, [1], "a", 3):
            with pytest.raises(ConfigError, match="versions"):
                fleet.publish(good, versions=bad)  # type: ignore[arg-type]
        for bad in (None, "a", ["a"], 3):
            with pytest.raises(ConfigError, match="adapters"):
                fleet.publish(bad, versions={"a": 1})  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="engine"):
            fleet.add_engine(None)  # type: ignore[arg-type]
        step(model, seed=5)
        both = {"a": export(model, copy=True), "b": export(trainer(tiny_model_dir, seed=2), copy=True)}
        with pytest.raises(ConfigError, match="Probe"):
            fleet.publish(both, versions={"a": 2, "b": 2}, verify={"a": "str"})  # type: ignore[dict-item]
        with pytest.raises(ConfigError, match="verify"):
            fleet.publish(both, versions={"a": 2, "b": 2}, verify={"zzz": Probe.from_model(model, PROMPT, max_tokens=2)})
        assert engine.list_adapters() == [], "an adapter was loaded before the call was refused"
    engine.close()
