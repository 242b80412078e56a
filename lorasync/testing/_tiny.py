"""Tiny local models, tokenizers and trained-looking LoRA adapters for tests and the demo.

Nothing is downloaded: the tokenizer is built with ``tokenizers`` and the model with
``transformers`` from a config. The model is a GQA Llama (hidden 256, 4 heads, 2 KV heads,
head_dim 64 — vLLM's CPU attention rejects head_dim 16) whose output distribution is made
peaked, so greedy decoding is stable across engines and dtypes.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["TINY_TARGETS", "make_peft_model", "make_tiny_model", "peft_reads_deprecated_checkpointing", "randomize_lora", "tiny_config"]

TINY_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VOCAB = 512


#: What every tiny model shares: the tokenizer's vocabulary and special ids, fp32, untied head.
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    torch_dtype="float32",
)


def tiny_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    values: dict[str, Any] = dict(
        COMMON,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(len(vocab), VOCAB):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def make_tiny_model(directory: str | os.PathLike[str] | None = None, *, seed: int = 0, **overrides: Any) -> Any:
    """Build the tiny Llama (and save model + tokenizer to ``directory`` when given).

    The LM head is scaled so logits are peaked: greedy tokens then survive fp32/bf16 noise.
    Never produces EOS by construction (its logit is pushed down), so generations have a
    fixed length.
    """
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**overrides)).eval()
    return peaked_and_saved(model, directory)


def peaked_and_saved(model: Any, directory: str | os.PathLike[str] | None) -> Any:
    """``model`` with its LM head scaled (peaked logits, EOS never wins), saved with the tokenizer
    to ``directory`` when given."""
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
        model.lm_head.weight[:4].zero_()  # pad/bos/eos/unk sit at logit 0, below the peaks
    if directory is not None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(path), safe_serialization=True)
        _tokenizer().save_pretrained(str(path))
    return model


def make_peft_model(
    base: Any,
    *,
    r: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = TINY_TARGETS,
    seed: int = 1,
    adapter_name: str = "default",
    std: float = 0.05,
    **lora_kwargs: Any,
) -> Any:
    """Wrap ``base`` in a PEFT LoRA model with non-trivial random A and B."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, **lora_kwargs)
    with peft_reads_deprecated_checkpointing():
        model = get_peft_model(base, cfg, adapter_name=adapter_name)
    randomize_lora(model, seed=seed, std=std)
    return model.eval()


@contextlib.contextmanager
def peft_reads_deprecated_checkpointing() -> Iterator[None]:
    """Drop the one FutureWarning ``get_peft_model`` causes: PEFT 0.21 reads transformers'
    deprecated ``is_gradient_checkpointing`` (transformers 5.2x) when it wraps a model. It is
    their debt, not the caller's, and it printed on every doc snippet; every other warning stays."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def randomize_lora(model: Any, *, seed: int, std: float = 0.05) -> None:
    """Give every LoRA factor random values (a "trained" adapter): linear ``lora_A/lora_B``,
    target-parameter (MoE expert) factors and embeddings' ``lora_embedding_A/B``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
