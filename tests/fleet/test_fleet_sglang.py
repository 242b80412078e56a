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
