"""A ``vllm.LLM`` colocated on the trainer's GPU (modest ``gpu_memory_utilization``), driven
through ``connect("vllm-inprocess", llm=...)``: the trainer takes optimizer steps on a PEFT model
on the same GPU and publishes its GPU tensors after each. The handoff is CUDA IPC into the
engine's worker, which keeps its copy in device memory (no host copy on the way: shared memory is
made to fail, and the worker's staged tensors are read back on the GPU), and the served tokens
and log-probs match HF+PEFT within bf16 tolerance, step after step."""

from __future__ import annotations

import os

import pytest
import torch
from _vllm_setup import DEVICE, DTYPE_NAME, Served, check, compare, fp32_twin, gpu_adapter, greedy, load_model, peft_model, prompt_ids

from lorasync import Publisher
from lorasync.engines import connect

NEW_TOKENS = 12


def _staged_devices(worker) -> list[str]:  # runs inside vLLM's worker (collective_rpc)
    from lorasync.engines.vllm import worker as ext

    return sorted({t.device.type for tensors, _ in ext._STAGED.values() for t in tensors.values()})


@pytest.fixture(scope="module")
def llm(vllm_here, qwen3_dir):
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # lets the test run _staged_devices in the worker
    from vllm import LLM

    from lorasync.engines.vllm import WORKER_EXTENSION

    kwargs = dict(
        model=str(qwen3_dir), enable_lora=True, max_lora_rank=16, max_loras=2, max_cpu_loras=4, dtype=DTYPE_NAME,
        enforce_eager=True, max_model_len=2048, worker_extension_cls=WORKER_EXTENSION,
    )  # fmt: skip
    # The trainer shares this GPU (on the CPU build: this machine's memory).
    engine = LLM(**kwargs, gpu_memory_utilization=0.2)
    yield engine
    engine.llm_engine.engine_core.shutdown()


def served(llm, request, prompt: list[int]) -> Served:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=1, prompt_logprobs=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=request, use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    logprobs = [float(step[t].logprob) for step, t in zip(out.outputs[0].logprobs, tokens)]
    plps = [float(step[prompt[i]].logprob) for i, step in enumerate(out.prompt_logprobs) if i > 0]
    return Served(tokens=tokens, logprobs=logprobs, prompt_logprobs=plps)


def test_colocated_llm_serves_each_optimizer_step_exactly(llm, qwen3_dir, tmp_path, monkeypatch):
    if DEVICE == "cuda":
        import lorasync.wire.d2h as d2h

        def no_host_copy(*args, **kwargs):
            raise AssertionError("the colocated handoff went through shared memory (a host copy)")

        monkeypatch.setattr(d2h, "to_shm_segment", no_host_copy)
    engine = connect("vllm-inprocess", llm=llm)
    model = peft_model(load_model(qwen3_dir), seed=5)
    base32 = fp32_twin(load_model(qwen3_dir))  # the base the adapter must be told apart from
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in model.parameters():
        p.requires_grad_(any(p is q for q in params))
    opt = torch.optim.AdamW(params, lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    pub = Publisher([engine], name="colocated", keep=1, root=tmp_path)
    seen = []
    try:
        for step in (1, 2):
            model.train()
            batch = torch.randint(4, vocab, (2, 32), generator=gen).to(DEVICE)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            model.eval()
            adapter = gpu_adapter(model)  # the trainer's GPU tensors, no copy (export would move them to the host)
            report = pub.publish(adapter, version=step)
            assert report.ok, report
            result = report.results[0]
            assert result.transport == "ipc", result.reason
            if DEVICE == "cuda":
                assert llm.collective_rpc(_staged_devices) == [["cuda"]]  # kept in device memory
            prompt = prompt_ids(20 + step, 24, vocab)
            model32 = fp32_twin(model)
            answer = served(llm, engine.lora_request(report.served_name), prompt)
            verdict = compare(answer, prompt, model, model32, base32, greedy(model, prompt, NEW_TOKENS))
            check(verdict, "colocated", step=step, timings=result.timings, loss=float(loss))
            seen.append(answer.prompt_logprobs)
            del model32
        assert seen[0] != seen[1]  # the second step's weights serve, not the first's
    finally:
        pub.close()
