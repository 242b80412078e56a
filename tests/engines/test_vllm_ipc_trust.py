"""The worker extension behind the HTTP IPC path rebuilds evicted adapters exactly (issue 28, item 30).

The suite's vLLM server (lorasync's worker extension loaded) keeps ``max_cpu_loras`` adapters in
its worker's LRU; one more, loaded from tensors, means every request in turn finds its adapter
evicted and vLLM rebuilds it from the staged tensors. vLLM folds alpha/r into lora_B in place as
it builds: a rebuild from the very tensors it folded last time would serve the adapter scaled
twice. Each adapter's tokens with lora_B scaled twice differ from PEFT's, so that cannot pass.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
import torch

from lorasync.engines.vllm import VLLMEngine
from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model, make_tiny_model

pytestmark = pytest.mark.vllm

PROMPTS = ([5, 6, 7, 8], [100, 200, 300])
NEW_TOKENS = 8


def _greedy(model: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_http_ipc_adapters_rebuilt_after_eviction_serve_peft_tokens(vllm_server: Any) -> None:
    adapters, expected = [], []
    for seed, std in ((1, 0.03), (7, 0.05)):
        model = make_peft_model(make_tiny_model(), r=8, alpha=16, seed=seed, std=std)  # scale 2
        adapters.append(export(model))
        expected.append([_greedy(model, p) for p in PROMPTS])
        twice = make_peft_model(make_tiny_model(), r=8, alpha=16, seed=seed, std=std)  # the export above is zero-copy
        with torch.no_grad():
            for name, param in twice.named_parameters():
                if ".lora_B." in name:
                    param.mul_(2.0)  # what a rebuild from the already-folded tensors would serve
        assert [_greedy(twice, p) for p in PROMPTS] != expected[-1]
    run = uuid.uuid4().hex[:8]
    names = [f"evict-{run}-{i}@v1" for i in range(vllm_server.max_cpu_loras + 1)]
    def slot_writes() -> int:
        answer = httpx.post(f"{vllm_server.url}/collective_rpc", json={"method": "lorasync_slot_writes", "args": []}, timeout=60)
        assert answer.status_code == 200, answer.text
        return int(answer.json()["results"][0])

    with VLLMEngine(vllm_server.url) as engine:
        assert engine.capabilities().tensor_load
        try:
            for i, name in enumerate(names):
                engine.load_adapter_tensors(name, adapters[i % 2])
            before = slot_writes()
            for _ in range(2):  # round robin over one adapter more than the LRU holds: each is a rebuild
                for i, name in enumerate(names):
                    for prompt, want in zip(PROMPTS, expected[i % 2]):
                        got = engine.generate(prompt, model=name, max_tokens=NEW_TOKENS).token_ids
                        assert list(got) == want, (name, prompt)
            # Every activation of a staged adapter (each one a rebuild here) went through
            # lorasync's slot write into vLLM's stacked buffers, and served PEFT's tokens.
            assert slot_writes() - before >= len(names)
            # Each build from staged tensors says where its time went (the GPU benchmark's breakdown).
            answer = httpx.post(f"{vllm_server.url}/collective_rpc", json={"method": "lorasync_load_timings", "args": []}, timeout=60)
            timed = [t for t in answer.json()["results"][0] if t["name"] in names]
            assert {t["name"] for t in timed} == set(names) and all(t["stage_s"] >= 0 and t["build_s"] > 0 for t in timed), timed
            # and the worker's whole add around each build (registration, the slot write) is timed too
            assert all(t["add_s"] is not None and t["add_s"] >= t["stage_s"] + t["build_s"] for t in timed), timed
            # Every build but the layout's first came from the layout vLLM built before (_template),
            # and each served PEFT's tokens above: the rebuilds of evicted adapters included.
            assert sum(t["templated"] for t in timed) >= len(timed) - 1, timed
        finally:
            for name in names:
                if name in engine.list_adapters():
                    engine.unload_adapter(name)
