"""The fleet against the SGLang contract peer (SGLang 0.5.23's own HTTP app and LoRA checks over a
tiny CPU model, tests/peers/sglang_contract.py) with ``--max-loaded-loras 3``: the same scenario
as on the PEFT engine and vLLM, tokens checked against PEFT's forward of each trainer."""

from __future__ import annotations


import httpx
import pytest
import torch

from lorasync import Fleet
from lorasync.engines.sglang import SGLangEngine
from lorasync.errors import CapacityError
from lorasync.exporters.fsdp import export
from tests.engines.test_sglang import _contract_server

PROMPT = [5, 17, 42, 99]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def sglang_url(tiny_model_dir, tmp_path_factory):
    # The suite's launcher of the contract peer; a later flag wins in SGLang's argparse.
    log = tmp_path_factory.mktemp("sglang-fleet") / "server.log"
    with _contract_server(tiny_model_dir, log, "--max-loaded-loras", "3") as url:
        yield url


def make(tiny_model_dir, seed):
    from transformers import AutoModelForCausalLM

    from lorasync.testing import make_peft_model

    return make_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), seed=seed, targets=TARGETS)


def reference(model) -> list[int]:
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(4):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


def step(model, *, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def loads(url) -> list[str]:
    return [r["path"] for r in httpx.get(f"{url}/_contract/requests").json() if r["method"] == "POST" and r["path"].startswith("/load_lora_adapter")]


def test_fleet_on_sglang_with_three_slots(sglang_url, tiny_model_dir, tmp_path):
    engine = SGLangEngine(sglang_url)
    for name in engine.list_adapters():
        engine.unload_adapter(name)
    models = {name: make(tiny_model_dir, s) for name, s in (("a", 1), ("b", 2), ("c", 3))}

    def serves(name: str, model) -> bool:
        return list(engine.generate(PROMPT, lora_name=name, max_new_tokens=4).output_ids) == reference(model)

    with Fleet([engine], root=tmp_path) as fleet:
        for name in models:
            fleet.register(name, keep=2, grace=0.0)
        for version in range(1, 11):
            for i, model in enumerate(models.values()):
                step(model, seed=10 * version + i)
            report = fleet.publish({n: export(m, copy=True) for n, m in models.items()}, versions=dict.fromkeys(models, version))
            assert report.ok, report
            assert sorted(engine.list_adapters()) == [f"{n}@v{version}" for n in "abc"]  # 3 slots: windows trimmed
            assert all(serves(f"{n}@v{version}", m) for n, m in models.items())
        httpx.post(f"{sglang_url}/_contract/reset")
        step(models["c"], seed=5)
        report = fleet.publish({n: export(m, copy=True) for n, m in models.items()}, versions=dict.fromkeys(models, 11))
        assert [report[n].status for n in "abc"] == ["unchanged", "unchanged", "loaded"] and len(loads(sglang_url)) == 1
        with pytest.raises(CapacityError, match="3 adapter slots"):
            fleet.register("d")
        assert sorted(engine.list_adapters()) == ["a@v10", "b@v10", "c@v11"]
        assert fleet.retire("a") == ["a@v10"]
        d = make(tiny_model_dir, 4)
        fleet.register("d")
        assert fleet.publish({"d": export(d, copy=True)}, versions={"d": 1})["d"].status == "loaded"
        assert serves("d@v1", d)
        for name in engine.list_adapters():  # a restart, as the client sees it
            engine.unload_adapter(name)
        restored = fleet.restore()
        assert {n: (t.status, t.version) for n, t in restored.tenants.items()} == {"b": ("restored", 10), "c": ("restored", 11), "d": ("restored", 1)}
        assert serves("c@v11", models["c"]) and serves("d@v1", d)
    engine.close()


@pytest.fixture(scope="module", params=["tensors", "streamed"])
def tensor_url(request, tiny_model_dir, tmp_path_factory):
    """A 4-slot contract peer taking tensors the 0.5.23 way or SGLang main's streamed way."""
    log = tmp_path_factory.mktemp(f"sglang-fleet-{request.param}") / "server.log"
    with _contract_server(tiny_model_dir, log, "--lora-protocol", request.param) as url:
        yield url


def _clean(url: str) -> SGLangEngine:
    engine = SGLangEngine(url)
    for name in engine.list_adapters():
        engine.unload_adapter(name)
    return engine


@pytest.mark.parametrize("add", [False, True], ids=["restore", "add_engine"])
def test_fleet_over_tensor_loads_publishes_every_tenant_and_restores(add, tensor_url, sglang_url, tiny_model_dir, tmp_path):
    """Three tenants over tensor loads (transport="ipc"), on both protocols: every round loads
    all three at once (SGLang main opens a weight-update session per streamed load and allows one
    at a time: the client makes them take turns), each serves its trainer's tokens; a restore
    with nothing lost and one with a tenant lost both report ok, and a second engine added
    gets every tenant's current version."""
    engine, other = _clean(tensor_url), _clean(sglang_url)
    models = {name: make(tiny_model_dir, s) for name, s in (("a", 1), ("b", 2), ("c", 3))}

    def serves(client: SGLangEngine, name: str, model) -> bool:
        return list(client.generate(PROMPT, lora_name=name, max_new_tokens=4).output_ids) == reference(model)

    with Fleet([engine], transport="ipc", root=tmp_path) as fleet:
        for name in models:
            fleet.register(name, keep=1, grace=0.0)
        for version in (1, 2):
            for i, model in enumerate(models.values()):
                step(model, seed=10 * version + i)
            report = fleet.publish({n: export(m, copy=True) for n, m in models.items()}, versions=dict.fromkeys(models, version))
            assert report.ok and all(t.status == "loaded" for t in report.tenants.values()), report
            assert sorted(engine.list_adapters()) == [f"{n}@v{version}" for n in "abc"]
            assert all(serves(engine, f"{n}@v{version}", m) for n, m in models.items())
        nothing_lost = fleet.restore()
        assert nothing_lost.ok, nothing_lost
        engine.unload_adapter("b@v2")  # lost, as after a crash of that adapter
        restored = fleet.restore()
        assert restored.ok, restored
        assert restored["b"].status == "restored" and restored["b"].version == 2, restored
        assert sorted(engine.list_adapters()) == ["a@v2", "b@v2", "c@v2"]
        assert all(serves(engine, f"{n}@v2", m) for n, m in models.items())
        if not add:
            return
        added = fleet.add_engine(other)
        assert added.ok and sorted(added.tenants) == ["a", "b", "c"], added
        assert all(t.status == "restored" for t in added.tenants.values()), added
        assert sorted(other.list_adapters()) == ["a@v2", "b@v2", "c@v2"]
        assert all(serves(other, f"{n}@v2", m) for n, m in models.items())
        fleet.remove_engine(other)
    engine.close()
    other.close()


def test_fleet_restore_over_tensor_loads_loads_only_where_the_version_is_missing(tensor_url, sglang_url, tiny_model_dir, tmp_path):
    """Issue 33 item 8: two engines taking tensors, one loses a tenant's version. The restore (asked
    for, and the one a round does by itself) loads it there alone: the engine that still lists it
    from a tensor load (SGLang names no source for it, so its content cannot be known) is left as
    it is, where before the restore published to it too and reported the tenant failed
    (StaleVersionError, "v1 would replace v1") though the restore worked."""
    engine, other = _clean(tensor_url), _clean(sglang_url)
    models = {name: make(tiny_model_dir, s) for name, s in (("a", 1), ("b", 2))}

    def serves(client: SGLangEngine, name: str, model) -> bool:
        return list(client.generate(PROMPT, lora_name=name, max_new_tokens=4).output_ids) == reference(model)

    def everywhere(versions: dict[str, int]) -> None:
        for client in (engine, other):
            assert sorted(client.list_adapters()) == sorted(f"{n}@v{v}" for n, v in versions.items()), client.url
            assert all(serves(client, f"{n}@v{v}", models[n]) for n, v in versions.items()), client.url

    with Fleet([engine, other], transport="ipc", root=tmp_path) as fleet:
        for name in models:
            fleet.register(name, keep=1, grace=0.0)
        report = fleet.publish({n: export(m, copy=True) for n, m in models.items()}, versions=dict.fromkeys(models, 1))
        assert report.ok, report
        everywhere({"a": 1, "b": 1})
        other.unload_adapter("b@v1")  # lost there, as after a crash of that adapter
        restored = fleet.restore()
        assert restored.ok and sorted(restored.tenants) == ["b"], restored
        assert restored["b"].status == "restored" and restored["b"].restored_on == [f"sglang at {other.url}"], restored
        everywhere({"a": 1, "b": 1})
        engine.unload_adapter("a@v1")  # a round restores what engines lost by itself
        step(models["b"], seed=7)
        report = fleet.publish({"b": export(models["b"], copy=True)}, versions={"b": 2})
        assert report.ok and report["a"].status == "restored" and report["b"].status == "loaded", report
        assert report["a"].restored_on == [f"sglang at {engine.url}"], report
        everywhere({"a": 1, "b": 2})
    engine.close()
    other.close()
