"""MoE LoRA served by a real GPU vLLM (its MoE LoRA kernels are Triton only, so the CPU build
cannot): the tiny random Qwen3-MoE of ``lorasync.testing`` (``make_case`` below) with a PEFT
``target_parameters`` LoRA on attention, the fused experts and the router, exported by lorasync as
one LoRA per expert (issue 23's format), published through the disk transport. Tokens and
log-probs match HF+PEFT within bf16 tolerance.

Router LoRA (issue 33 item 23): vLLM 0.26 loads ``mlp.gate`` LoRA keys and serves the adapter
as if it had none. lorasync's release table (``_lora_compat.LoaderRules.router_lora``) says which
releases apply it. Where the running release does not, the publish must be refused before
anything moves (``IncompatibleAdapterError``, nothing served under the name); where it does, the
answer must match HF+PEFT *with* the router LoRA and not without it. Either way the test fails
when the table is wrong for the release on the machine (``gpu_vllm_tests.jsonl``, ``moe-router``).
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import torch
from _vllm_setup import DEVICE, DTYPE, REHEARSAL, check, compare, completion_body, fp32_twin, greedy, parse_completion, prompt_ids, record

from conftest import gpu_server
from lorasync import Adapter, Publisher
from lorasync.engines import connect
from lorasync.engines.vllm._lora_compat import rules_for
from lorasync.errors import IncompatibleAdapterError
from lorasync.exporters.fsdp import export
from lorasync.testing import MoeCase

NEW_TOKENS = 10
pytestmark = pytest.mark.skipif(REHEARSAL, reason="vLLM's MoE LoRA kernels need a GPU (the CPU build dies on them)")


ROUTER_BOOST = 40.0  # the router LoRA's B scaled up so its effect stands far above bf16 noise


def make_case(directory: Path) -> MoeCase:
    """``make_moe_case``'s model and LoRA, with the LM head at its natural scale (the builder's
    x40 peaking turns bf16 rounding into nats of log-prob error) and a decisive router LoRA."""
    from transformers import AutoModelForCausalLM

    from lorasync.testing import make_moe_peft_model, make_tiny_moe_model
    from lorasync.testing._tiny import _tokenizer

    base_dir = directory / "base"
    model = make_tiny_moe_model()
    with torch.no_grad():
        model.lm_head.weight.div_(10.0)
    model.save_pretrained(str(base_dir), safe_serialization=True)
    _tokenizer().save_pretrained(str(base_dir))
    peft = make_moe_peft_model(AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32), router=True, seed=1, std=0.05)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if ".mlp.gate." in name and "lora_B" in name:
                p.mul_(ROUTER_BOOST)
    return MoeCase(base_dir=base_dir, peft_model=peft, adapter=export(peft, copy=True))


@pytest.fixture(scope="module")
def case(vllm_here, tmp_path_factory):
    return make_case(tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def moe_server(case, tmp_path_factory):
    log = Path(os.environ.get("OUT", str(tmp_path_factory.mktemp("vllm-logs")))) / "vllm-moe.log"
    with gpu_server(case.base_dir, log, max_loras=2, max_cpu_loras=4, max_rank=8, max_len=512) as server:
        yield server


def _without_router(adapter: Adapter) -> Adapter:
    tensors = {k: v for k, v in adapter.tensors.items() if ".mlp.gate." not in k}
    return Adapter(tensors, adapter.config)


def _reference(case, router: bool):
    """HF+PEFT on the GPU in the serving dtype, and its fp32 twin (router LoRA on or zeroed)."""
    model = fp32_twin(case.peft_model).to(DEVICE)
    if not router:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".mlp.gate." in name and "lora_" in name:
                    p.zero_()
    return model.to(DTYPE), fp32_twin(model.to(DTYPE))


def test_moe_expert_lora_served_within_bf16_tolerance(case, moe_server, tmp_path):
    adapter = case.adapter
    assert any(".mlp.experts.0.gate_proj.lora_A" in k for k in adapter.tensors), sorted(adapter.tensors)[:8]
    engine = connect("vllm", moe_server.url, timeout=300)
    base32 = fp32_twin(case.peft_model.get_base_model()).to(DEVICE)  # LoRA layers included: disable below
    answers = {}
    version = engine.capabilities().version
    applies = rules_for(version).router_lora
    try:
        for router in (False, True):
            pub = Publisher([engine], name=f"moe-router{int(router)}", keep=1, root=tmp_path / f"r{int(router)}", transport="disk")
            report = pub.publish(adapter if router else _without_router(adapter), version=1)
            if router and not applies:
                # A release that ignores router LoRA: refused before anything moves, never "ok".
                error = report.results[0].error
                record("moe-router", version=version, refused=True, error=repr(error))
                assert isinstance(error, IncompatibleAdapterError) and "router" in str(error), report
                assert not any(n.startswith("moe-router1") for n in engine.list_adapters()), engine.list_adapters()
                pub.close()
                continue
            if not report.ok:
                record("moe-publish", router=router, report=str(report))
            assert report.ok, report
            prompt = prompt_ids(50, 16, case.peft_model.config.vocab_size)
            response = httpx.post(f"{moe_server.url}/v1/completions", json=completion_body(report.served_name, prompt, NEW_TOKENS), timeout=300)
            assert response.status_code == 200, response.text
            answers[router] = (prompt, parse_completion(response.json()["choices"][0], prompt))
            pub.close()
        refs = {r: _reference(case, r) for r in (False, True)}
        with torch.no_grad():
            for name, p in base32.named_parameters():
                if "lora_B" in name:
                    p.zero_()  # the base model: every LoRA off
        # Without router LoRA: attention + experts must be exact.
        prompt, served = answers[False]
        model, model32 = refs[False]
        verdict = compare(served, prompt, model, model32, base32, greedy(model, prompt, NEW_TOKENS))
        check(verdict, "moe-experts", tokens=served.tokens)
        if not applies:
            return  # refused above; nothing with router LoRA was served
        # With router LoRA, on a release said to apply it: vLLM must serve the router reference.
        prompt, served = answers[True]
        outcome = {}
        for router in (True, False):
            model, model32 = refs[router]
            v = compare(served, prompt, model, model32, None, greedy(model, prompt, NEW_TOKENS))
            outcome[router] = v.as_dict()
            if v.problems:  # not this reference's tokens at all
                outcome[router]["err_engine"] = float("inf")
        effect = float(
            (torch.tensor(answers[True][1].prompt_logprobs) - torch.tensor(answers[False][1].prompt_logprobs)).abs().max()
        )
        applied = outcome[True]["err_engine"] <= outcome[True].get("tol", 0) and outcome[True]["err_engine"] < outcome[False]["err_engine"]
        ignored = outcome[False]["err_engine"] <= outcome[False].get("tol", 0) and not applied
        record("moe-router", version=version, applied=applied, ignored=ignored, served_effect_of_router=effect, outcome=outcome)
        assert applied, (
            f"vLLM {version} reported the router LoRA loaded but served "
            f"{'the adapter without it' if ignored else 'neither reference'}: set router_lora=False for this "
            f"release in lorasync/engines/vllm/_lora_compat.py. {outcome}"
        )
    finally:
        engine.close()
