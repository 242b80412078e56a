"""A real vLLM OpenAI server on the GPU (vLLM 0.26 on the H200) serving what lorasync publishes:
disk, CUDA IPC into the worker extension (vLLM's real worker LoRA manager builds the adapter)
and merged. Each is checked against HF+PEFT on the same GPU (``_vllm_setup.compare``): greedy
tokens, their log-probs and every prompt token's log-prob within bf16 tolerance of an fp32
reference, on a random-weight model of the Qwen3-0.6B shape with an r16 all-linear LoRA."""

from __future__ import annotations

import httpx
import pytest
import torch
from _vllm_setup import (
    DEVICE,
    completion_body,
    compare,
    check,
    fp32_twin,
    gpu_adapter,
    greedy,
    load_model,
    parse_completion,
    peft_model,
    prompt_ids,
    record,
)

from lorasync import Publisher
from lorasync.engines import connect
from lorasync.exporters.fsdp import export

NEW_TOKENS = 12
PROMPT_LEN = 24


@pytest.fixture(scope="module")
def engine(vllm_gpu_server):
    eng = connect("vllm", vllm_gpu_server.url, timeout=300)
    yield eng
    eng.close()


def ask(server, model: str, prompt: list[int]):
    response = httpx.post(f"{server.url}/v1/completions", json=completion_body(model, prompt, NEW_TOKENS), timeout=300)
    assert response.status_code == 200, response.text
    return parse_completion(response.json()["choices"][0], prompt)


@pytest.fixture(scope="module")
def base32(qwen3_dir):
    return fp32_twin(load_model(qwen3_dir))


@pytest.mark.parametrize("transport", ["disk", "ipc"])
def test_adapter_served_within_bf16_tolerance_of_peft(transport, engine, vllm_gpu_server, qwen3_dir, base32, tmp_path, monkeypatch):
    if transport == "ipc" and DEVICE == "cuda":
        # A GPU adapter on this host goes by CUDA IPC into the worker: no shared-memory copy.
        import lorasync.engines.vllm._client as client

        def no_host_copy(*args, **kwargs):
            raise AssertionError("the CUDA IPC handoff fell back to a shared-memory copy")

        monkeypatch.setattr(client, "to_shm_segment", no_host_copy)

        def no_stage_rpc(*args, **kwargs):
            raise AssertionError("the load did not carry its CUDA IPC spec (one round trip): it staged by RPC first")

        monkeypatch.setattr(client.VLLMEngine, "_stage_cuda", no_stage_rpc)
    model = peft_model(load_model(qwen3_dir), seed={"disk": 1, "ipc": 2}[transport])
    model32 = fp32_twin(model)
    adapter = gpu_adapter(model)  # the trainer's own GPU tensors, no copy
    assert {t.device.type for t in adapter.tensors.values()} == {DEVICE}
    pub = Publisher([engine], name=f"gpu-{transport}", transport=transport, root=tmp_path, keep=1)
    try:
        report = pub.publish(adapter, version=1)
        assert report.ok, report
        result = report.results[0]
        assert result.transport == transport
        for seed in (10, 11):
            prompt = prompt_ids(seed, PROMPT_LEN, model.config.vocab_size)
            served = ask(vllm_gpu_server, report.served_name, prompt)
            verdict = compare(served, prompt, model, model32, base32, greedy(model, prompt, NEW_TOKENS))
            check(verdict, f"server-{transport}", prompt_seed=seed, timings=result.timings)
    finally:
        pub.close()


def test_merged_full_weights_within_bf16_tolerance_of_peft(engine, vllm_gpu_server, qwen3_dir, base32, tmp_path):
    model = peft_model(load_model(qwen3_dir), seed=3)
    model32 = fp32_twin(model)
    pub = Publisher([engine], name="gpu-merged", transport="merged", root=tmp_path, base=qwen3_dir)
    try:
        report = pub.publish(export(model), version=1)
        assert report.ok, report
        assert report.results[0].transport == "merged"
        prompt = prompt_ids(12, PROMPT_LEN, model.config.vocab_size)
        served = ask(vllm_gpu_server, "base", prompt)
        verdict = compare(served, prompt, model, model32, base32, greedy(model, prompt, NEW_TOKENS))
        check(verdict, "server-merged", timings=report.results[0].timings, bytes_moved=report.results[0].bytes_moved)
    finally:
        pub.restore_base()
        pub.close()
    # The pristine base serves again, exactly as HF's base model.
    base = load_model(qwen3_dir)
    prompt = prompt_ids(13, PROMPT_LEN, base.config.vocab_size)
    served = ask(vllm_gpu_server, "base", prompt)
    verdict = compare(served, prompt, base, base32, None, greedy(base, prompt, NEW_TOKENS))
    record("server-merged-restored", **verdict.as_dict())
    assert not verdict.problems, verdict.problems
    del base
    torch.cuda.empty_cache() if DEVICE == "cuda" else None


def test_default_publish_of_export_is_device_to_device_exact(engine, vllm_gpu_server, qwen3_dir, base32, tmp_path, monkeypatch):
    """What the README shows, on a GPU trainer: ``pub.publish(fsdp.export(model))`` with no
    transport named. The export keeps the GPU tensors, the default picks CUDA IPC into the
    engine's GPU, the content hash is taken on the GPU, and nothing of the adapter crosses to the
    trainer's host memory (the profiler sees at most the hash's 16-byte result come back)."""
    if DEVICE != "cuda":
        pytest.skip("device-to-device needs the GPU")
    import lorasync.engines.vllm._client as client

    def no_host_copy(*args, **kwargs):
        raise AssertionError("the publish fell back to a shared-memory copy")

    monkeypatch.setattr(client, "to_shm_segment", no_host_copy)
    model = peft_model(load_model(qwen3_dir), seed=5)
    model32 = fp32_twin(model)
    pub = Publisher([engine], name="gpu-default", root=tmp_path, keep=2)
    try:
        pub.publish(export(model), version=1).raise_for_errors()  # warm-up: allocator, kernels
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(-1.0)
        model32 = fp32_twin(model)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            adapter = export(model)
            assert {t.device.type for t in adapter.tensors.values()} == {"cuda"}
            report = pub.publish(adapter, version=2).raise_for_errors()
            torch.cuda.synchronize()
        result = report.results[0]
        assert result.transport == "ipc", result.reason
        assert "CUDA IPC" in result.reason
        d2h = [e for e in prof.events() if "DtoH" in e.name or "Device -> Pageable" in e.name or "Device -> Pinned" in e.name]
        assert len(d2h) <= 1, [e.name for e in d2h]
        prompt = prompt_ids(21, PROMPT_LEN, model.config.vocab_size)
        served = ask(vllm_gpu_server, report.served_name, prompt)
        verdict = compare(served, prompt, model, model32, base32, greedy(model, prompt, NEW_TOKENS))
        check(verdict, "server-default-export", timings={**report.timings, **result.timings})
    finally:
        pub.close()
