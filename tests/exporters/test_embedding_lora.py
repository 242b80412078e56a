"""Embedding LoRA (PEFT ``lora_embedding_A/B``) from the trainer to the engines (issue 28 item 6).

PEFT keeps an ``nn.Embedding``'s factors as ``lora_embedding_A`` ``[r, num_embeddings]`` and
``lora_embedding_B`` ``[embedding_dim, r]``, saved without a ``.weight`` suffix. ``fsdp.export``
used to drop them silently (they matched no ``lora_{A,B}.weight`` pattern), so an ``embed_tokens``
LoRA reached no engine and the engine served other log-probs than training (74.8 off on the tiny
model). They are exported now, under PEFT's own key names, which vLLM 0.32 (``VocabParallelEmbeddingWithLoRA``:
A ``[r, vocab]``, B ``[dim, r]``), SGLang 0.5.23 and PEFT read as they are.
"""

from __future__ import annotations

import copy

from pathlib import Path
from typing import Any

import pytest
import torch

from lorasync import Adapter, BaseWeights, Publisher
from lorasync.engines import connect
from lorasync.exporters.fsdp import export
from lorasync.testing import TINY_TARGETS, make_peft_model, make_tiny_model

EMBED = "model.embed_tokens"
PROMPTS = ([5, 17, 99, 230, 41], [300, 12, 7], [64, 65, 66, 67, 68, 69])
NEW_TOKENS = 6


def peft_greedy(model: Any, prompt: list[int], n: int = NEW_TOKENS) -> tuple[list[int], list[float]]:
    """HF+PEFT's greedy tokens, and each token's log-prob from one forward over prompt + tokens
    (the way the PEFT engine scores them, so the two compare at fp32 precision)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=n,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        tokens = out[0, len(prompt) :].tolist()
        rows = torch.log_softmax(model(input_ids=out[:, :-1]).logits[0].float(), -1)[len(prompt) - 1 :]
    return tokens, [float(rows[i, t]) for i, t in enumerate(tokens)]


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path) -> Any:
    """A PEFT model with LoRA on the token embedding and the attention/MLP linears (the
    embedding's factors are large enough to move every log-prob)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return with_trained_embedding(make_peft_model(base, r=8, seed=5, targets=("embed_tokens", *TINY_TARGETS), std=0.2))


def with_trained_embedding(model: Any) -> Any:
    """Random values for the embedding's factors too (PEFT starts lora_embedding_A at zero, so an
    untrained embedding LoRA would change nothing and prove nothing)."""
    gen = torch.Generator().manual_seed(17)
    emb = model.base_model.model.model.embed_tokens
    with torch.no_grad():
        for factor in (emb.lora_embedding_A["default"], emb.lora_embedding_B["default"]):
            factor.copy_(torch.randn(factor.shape, generator=gen) * 0.2)
    return model


def test_export_keeps_the_embedding_factors_under_peft_names(trained: Any) -> None:
    adapter = export(trained)
    assert adapter.is_embedding(EMBED)
    a, b = adapter.pair(EMBED)
    emb = trained.base_model.model.model.embed_tokens
    assert torch.equal(a, emb.lora_embedding_A["default"]) and torch.equal(b, emb.lora_embedding_B["default"])
    assert (tuple(a.shape), tuple(b.shape)) == ((8, 512), (256, 8))
    assert f"base_model.model.{EMBED}.lora_embedding_A" in adapter.tensors
    assert "embed_tokens" in adapter.config.target_modules


def test_saved_adapter_round_trips_and_matches_peft_save(trained: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    adapter = export(trained)
    adapter.save(tmp_path / "ours")
    trained.save_pretrained(tmp_path / "peft", save_embedding_layers=False)  # the full base embedding is no LoRA
    ours, theirs = load_file(tmp_path / "ours" / "adapter_model.safetensors"), load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert Adapter.load(tmp_path / "peft").content_hash == adapter.content_hash


@pytest.mark.parametrize("transport", ["disk", "ipc", "merged"])
def test_peft_engine_serves_peft_tokens_and_logprobs(trained: Any, tiny_model_dir: Path, tmp_path: Path, transport: str) -> None:
    engine = connect("peft", base_model_path=tiny_model_dir)
    base = BaseWeights.from_pretrained(tiny_model_dir)
    with Publisher([engine], name="emb", transport=transport, root=tmp_path, base=base) as publisher:
        report = publisher.publish(export(trained), version=1).raise_for_errors()
    served = None if transport == "merged" else report.served_name
    # Merged weights are rounded once, as PEFT's own merge rounds them: that is the reference.
    reference = copy.deepcopy(trained).merge_and_unload() if transport == "merged" else trained
    for prompt in PROMPTS:
        tokens, logprobs = engine.greedy(served, prompt, NEW_TOKENS)
        want_tokens, want_logprobs = peft_greedy(reference, prompt)
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-5)


def test_the_embedding_factors_matter(trained: Any) -> None:
    """Without them (what main's export served) the trained tokens' log-probs are far off (74.8 at
    most on this model): the tests above would catch a dropped embedding."""
    full = export(trained)
    dropped = {k: v for k, v in full.tensors.items() if EMBED not in k}
    engine = connect("peft", model=make_tiny_model())
    engine.load_adapter_tensors("dropped", Adapter(dropped, full.config.with_(target_modules=())))
    prompt = list(PROMPTS[0])
    tokens, want = peft_greedy(trained, prompt)
    rows = engine.logprobs(prompt + tokens[:-1], adapter="dropped")[len(prompt) - 1 :]
    assert max(abs(float(rows[i, t]) - w) for i, (t, w) in enumerate(zip(tokens, want))) > 1.0
