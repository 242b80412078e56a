"""A real vLLM server behind one simulated node: 4 gloo ranks, node "alpha" (ranks 0, 1; src)
whose only engine is a vLLM client at a dead port, node "beta" (ranks 2, 3; explicit leader
rank 3) in front of the session's vLLM CPU server. The adapter crosses the process group, beta's
leader writes it under beta's own root, vLLM loads it from there, the probe sent along is
verified through vLLM, and vLLM's greedy output equals the trainer's PEFT model."""

from __future__ import annotations

import json

import pytest
import torch
from _dist_publish_worker import run_vllm

from lorasync import Probe
from lorasync.engines.vllm import VLLMEngine
from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model

pytestmark = pytest.mark.vllm

DEADLINE_S = 150  # vLLM loads and generates on a busy 2-core box
PROMPTS = ([5, 17, 99, 230, 41], [300, 12, 7])


def test_vllm_node_serves_what_the_trainer_trained(vllm_server, tiny_model_dir, tmp_path, spawn_ranks, dead_url):
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), seed=61)
        adapter_dir = tmp_path / "trained"
        export(model).save(adapter_dir)
        probe = Probe.from_model(model, PROMPTS[0], max_tokens=4, atol=1e-3)
        with torch.no_grad():
            expected = [
                model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=6,
                               do_sample=False)[0, len(p):].tolist()
                for p in PROMPTS
            ]
    finally:
        torch.set_num_threads(threads)

    out = tmp_path / "ranks"
    out.mkdir()
    dead = dead_url
    probe_json = {"prompt_ids": list(probe.prompt_ids), "expected_ids": list(probe.expected_ids),
                  "expected_logprobs": list(probe.expected_logprobs), "atol": probe.atol}
    engine = VLLMEngine(vllm_server.url, timeout=120)
    try:
        spawn_ranks(run_vllm, (str(out), vllm_server.url, dead, str(adapter_dir), probe_json), nprocs=4, out=out,
                    deadline_s=DEADLINE_S)
        report = json.loads((out / "report.json").read_text())
        assert [json.loads((out / f"outcome-{r}.json").read_text())["report"] for r in range(4)] == [True, False, False, False]
        assert json.loads((out / "outcome-2.json").read_text())["leaders"] == {"alpha": 0, "beta": 3}
        by_node = {n["node"]: n for n in report["nodes"]}
        alpha, beta = by_node["alpha"]["results"], by_node["beta"]["results"]
        # the dead engine is reported; it did not hold up beta
        assert [(r["status"], r["error"]["type"]) for r in alpha] == [("failed", "EngineUnavailableError")]
        assert dead in alpha[0]["error"]["message"]
        assert [(r["status"], r["transport"], r["served_name"]) for r in beta] == [("loaded", "disk", "multinode@v1")]
        assert "verified through the engine" in beta[0]["reason"]
        assert report["bytes_sent"] == report["payload_bytes"] == by_node["beta"]["bytes_received"]
        # beta's leader wrote v1 into its own run under its node's root
        assert [p.name for p in (out / "root-beta" / "multinode").glob("*/v1/adapter_model.safetensors")] == ["adapter_model.safetensors"]
        assert "multinode@v1" in engine.list_adapters()
        for prompt, tokens in zip(PROMPTS, expected):
            assert engine.greedy("multinode@v1", list(prompt), 6)[0] == tokens
        assert any(engine.greedy(None, list(p), 6)[0] != t for p, t in zip(PROMPTS, expected))  # the adapter matters
    finally:
        for name in engine.list_adapters():
            if name.startswith("multinode@"):
                engine.unload_adapter(name)
        engine.close()
