"""TRL's AsyncGRPOTrainer (TRL 1.16, ``trl.experimental.async_grpo``) training the tiny model on
the CPU against a data-parallel vLLM CPU server (two engine cores behind one API server), its
adapter synced by lorasync (:mod:`lorasync.integrations.trl_async_grpo`).

TRL alone falls back to merged full-weight sync for any ``data_parallel_size > 1``. Here the
trainer keeps the adapter path: TRL's own sync entry point (``_sync_weight``, as its train-begin
callback and its per-step callback call it: pause, export, load, resume, move the version) is a
lorasync publish each time, the rollout loop's model name is ``policy@v<N>``, and after every
sync both engine cores answer that name with exactly PEFT's greedy tokens for the trainer's
current adapter; the two newest versions stay loaded (``max_staleness=1``).

Not run here: ``trainer.train()`` itself. TRL 1.16's AsyncGRPO training forward is
FlashAttention-3 "tree attention" (a GPU kernel fetched from the Hub) and its constructor reads
CUDA's peak FLOPs; on this CPU-only machine the optimizer step is stood in for by moving every
LoRA factor, and the rollout worker process is not started.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from lorasync.engines import connect
from lorasync.testing import TINY_TARGETS
from lorasync.testing.vllm_server import VLLMServer
from tests.engines.test_vllm_data_parallel import PROMPTS, every_engine_serves
from tests.support.greedy import peft_greedy
from tests.support.rewards import count_reward

pytestmark = pytest.mark.vllm
pytest.importorskip("trl.experimental.async_grpo")


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # the tiny tokenizer has none
    return tok


def _dataset() -> Any:
    from datasets import Dataset

    prompts = [[{"role": "user", "content": " ".join(f"w{10 + (i * 7 + j) % 400}" for j in range(5))}] for i in range(16)]
    return Dataset.from_dict({"prompt": prompts})


def _step(model: Any, seed: int) -> None:
    """What an optimizer step does to the adapter: every LoRA factor moves."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)


def _reference(model_dir: Path, trained: Any) -> Any:
    """PEFT on the base with plain attention, holding the trainer's current LoRA weights (the
    trainer's own forward is TRL's GPU tree attention)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager"), LoraConfig(r=8, lora_alpha=16, target_modules=list(TINY_TARGETS)))
    lora = {k: v for k, v in trained.state_dict().items() if "lora_" in k}
    missing = [k for k in ref.state_dict() if "lora_" in k and k not in lora]
    assert lora and not missing, missing[:4]
    ref.load_state_dict(lora, strict=False)
    return ref.eval()


def test_async_grpo_keeps_adapter_sync_on_a_data_parallel_vllm_and_every_core_serves_each_version(vllm_dp_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from peft import LoraConfig
    from trl.experimental.async_grpo import AsyncGRPOConfig
    from trl.experimental.async_grpo import async_grpo_trainer

    # TRL 1.16's AsyncGRPO is written for GPUs: its constructor reads the GPU's peak FLOPs (for
    # an MFU number in its logs) and its training forward is FlashAttention-3 tree attention.
    # The FLOPs reader is given a number here; the forward is not run (see the module docstring).
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda *a, **k: 1e12)
    # Its rollout worker only speaks HTTP to the server, but refuses to be built unless vLLM is
    # importable in the trainer's environment; vLLM lives in its own venv here.
    from trl.experimental.async_grpo import async_rollout_worker

    monkeypatch.setattr(async_rollout_worker, "is_vllm_available", lambda: True)

    from lorasync.integrations.trl_async_grpo import LoraSyncAsyncGRPOTrainer, _ServedNameLoop

    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        vllm_server_base_url=vllm_dp_server.url,
        weight_sync_steps=1,
        max_staleness=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        dtype="float32",
    )
    trainer = LoraSyncAsyncGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=count_reward,
        args=args,
        train_dataset=_dataset(),
        processing_class=_tokenizer(tiny_model_dir),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=list(TINY_TARGETS)),
        lorasync_name="policy",
        lorasync_root=tmp_path / "lorasync",
    )
    # TRL alone syncs merged weights to this server (data_parallel_size 2); here: the adapter.
    assert trainer._lora_sync, "the probe fell back to merged sync"
    assert trainer.rollout_worker._loop_cls is _ServedNameLoop
    model = trainer.accelerator.unwrap_model(trainer.model)
    try:
        # TRL's own sync entry point: the cold sync at train begin, then one per optimizer step.
        for step in range(4):
            if step:
                _step(model, seed=step)
            trainer._sync_weight()
            report = trainer.reports[-1]
            assert report.ok and report.version == step + 1 == trainer.model_version, report
            assert trainer.rollout_worker.model_version == trainer.model_version
            # What the rollout loop asks vLLM for: lorasync's served name of the current version.
            asked = _ServedNameLoop._request_model.fget(SimpleNamespace(lora_name=trainer._lora_name, model_name="tiny-base", model_version=trainer.model_version))
            assert asked == report.served_name == f"policy@v{step + 1}"
            ref = _reference(tiny_model_dir, model)
            every_engine_serves(vllm_dp_server, asked, [peft_greedy(ref, list(p)) for p in PROMPTS])
            report.settled()
        # max_staleness=1: the two newest versions stay loaded, older ones were retired.
        listed = {n for n in httpx.get(f"{vllm_dp_server.url}/v1/models", timeout=60).json()["data"] for n in [n["id"]]}
        assert {"policy@v3", "policy@v4"} <= listed and not {"policy@v1", "policy@v2"} & listed, listed
        assert len({r.content_hash for r in trainer.reports}) == 4
    finally:
        httpx.post(f"{vllm_dp_server.url}/resume", timeout=60)  # never leave the shared server paused
        if trainer.publisher is not None:
            trainer.publisher.close()
        with connect("vllm", vllm_dp_server.url) as engine:
            for name in engine.list_adapters():
                engine.unload_adapter(name)
