"""An ``embed_tokens`` LoRA through the real vLLM 0.32 CPU server (issue 28 item 6).

``fsdp.export`` used to drop PEFT's ``lora_embedding_A/B`` silently, so the server served the
other modules' LoRA over the untouched embedding. vLLM 0.32 serves embedding LoRA from PEFT's own
keys and shapes (``VocabParallelEmbeddingWithLoRA.set_lora``: A ``[r, vocab]`` transposed into its
``[vocab, r]`` slot, B ``[dim, r]``), through both lorasync paths: disk, and the worker extension's
staged tensors (``ipc``). The server's greedy tokens and log-probs must be PEFT's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lorasync import Publisher
from lorasync.engines import connect
from lorasync.exporters.fsdp import export
from lorasync.testing import TINY_TARGETS, make_peft_model, make_tiny_model

pytestmark = pytest.mark.vllm

PROMPTS = ([5, 6, 7, 8], [100, 200, 300], [11, 12, 13, 14, 15, 16])
NEW_TOKENS = 8
LOGPROB_ATOL = 1e-3  # fp32 on both sides, as tests/engines/test_vllm.py


def peft_greedy(model: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
            return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]


@pytest.fixture(scope="module")
def trained() -> Any:
    model = make_peft_model(make_tiny_model(), r=8, seed=5, targets=("embed_tokens", *TINY_TARGETS), std=0.2)
    gen = torch.Generator().manual_seed(17)  # PEFT starts lora_embedding_A at zero: give it values
    emb = model.base_model.model.model.embed_tokens
    with torch.no_grad():
        for factor in (emb.lora_embedding_A["default"], emb.lora_embedding_B["default"]):
            factor.copy_(torch.randn(factor.shape, generator=gen) * 0.2)
    return model


@pytest.mark.parametrize("transport", ["disk", "ipc"])
def test_vllm_serves_the_embedding_lora(vllm_server: Any, trained: Any, tmp_path: Path, transport: str) -> None:
    adapter = export(trained)
    engine = connect("vllm", vllm_server.url)
    with Publisher([engine], name=f"emb-{transport}", transport=transport, root=tmp_path) as publisher:
        report = publisher.publish(adapter, version=1).raise_for_errors()
        assert report.results[0].transport == transport
        for prompt in PROMPTS:
            tokens, logprobs = engine.greedy(report.served_name, list(prompt), NEW_TOKENS)
            want_tokens, want_logprobs = peft_greedy(trained, list(prompt))
            assert tokens == want_tokens
            assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_ATOL)
    engine.close()
    assert "base_model.model.model.embed_tokens.lora_embedding_A" in adapter.tensors
