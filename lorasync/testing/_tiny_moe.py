"""A tiny random Qwen3-MoE and its PEFT ``target_parameters`` LoRA, built locally (no downloads).

The model has 2 layers of 4 experts (top-2) over hidden 128, head_dim 64 (vLLM's CPU attention
rejects smaller heads); transformers 5 stores its experts fused (``mlp.experts.gate_up_proj``
``[4, 128, 128]``, ``down_proj`` ``[4, 128, 64]``) and saves them per expert, the checkpoint layout
vLLM and SGLang load. Logits are made peaked and the router decisive, so greedy tokens and expert
choices are stable across engines and dtypes.

:func:`make_moe_case` is the whole fixture in one call (base on disk, trained PEFT model, the
exported per-expert :class:`~lorasync.Adapter`): the GPU suite serves that adapter on a real vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lorasync.testing._tiny import COMMON, peaked_and_saved, peft_reads_deprecated_checkpointing, randomize_lora

__all__ = ["MOE_ATTENTION", "MoeCase", "make_moe_case", "make_moe_peft_model", "make_tiny_moe_model", "tiny_moe_config"]

MOE_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
ROUTER_PARAMETER = "mlp.gate.weight"


def tiny_moe_config(**overrides: Any) -> Any:
    """The tiny ``Qwen3MoeConfig`` (every layer sparse, 4 experts, top-2)."""
    from transformers import Qwen3MoeConfig

    values: dict[str, Any] = dict(
        COMMON,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )
    values.update(overrides)
    return Qwen3MoeConfig(**values)


def make_tiny_moe_model(directory: str | os.PathLike[str] | None = None, *, seed: int = 0, **overrides: Any) -> Any:
    """Build the tiny Qwen3-MoE (and save model + tokenizer to ``directory`` when given).

    The LM head is scaled so logits are peaked and EOS never wins; the routers are scaled so
    each token's top-2 experts win by a margin (no near-ties for two engines to break apart).
    """
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_moe_config(**overrides)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    return peaked_and_saved(model, directory)


def make_moe_peft_model(
    base: Any,
    *,
    r: int = 8,
    alpha: float = 16,
    attention: tuple[str, ...] = MOE_ATTENTION,
    experts: bool = True,
    router: bool = True,
    seed: int = 1,
    std: float = 0.05,
    **lora_kwargs: Any,
) -> Any:
    """Wrap ``base`` in a PEFT LoRA with random factors on the attention modules
    (``target_modules``), the fused experts and the router (``target_parameters``)."""
    from peft import LoraConfig, get_peft_model

    parameters = [*(EXPERT_PARAMETERS if experts else ()), *((ROUTER_PARAMETER,) if router else ())]
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(attention) or None,
        target_parameters=parameters or None,
        lora_dropout=0.0,
        **lora_kwargs,
    )
    with peft_reads_deprecated_checkpointing():
        model = get_peft_model(base, cfg)
    randomize_lora(model, seed=seed, std=std)
    return model.eval()


@dataclass
class MoeCase:
    """A tiny Qwen3-MoE on disk, a trained PEFT ``target_parameters`` LoRA over it, and that LoRA
    exported by lorasync as one LoRA per expert."""

    base_dir: Path
    peft_model: Any
    adapter: Any

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """HF + PEFT's greedy tokens after ``prompt`` (the reference an engine must reproduce)."""
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = self.peft_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        return out[0, len(prompt) :].tolist()


def make_moe_case(directory: str | os.PathLike[str], *, r: int = 8, alpha: float = 16, router: bool = True, seed: int = 1, std: float = 0.05) -> MoeCase:
    """Save the tiny Qwen3-MoE under ``directory``/base, train-like a PEFT LoRA on it and export it.

    Args:
        directory: where the base checkpoint (safetensors, config, tokenizer) is written.
        r / alpha: the LoRA's rank and alpha.
        router: also adapt the router (``mlp.gate.weight``).
        seed / std: the random factors.

    Returns:
        `MoeCase`: ``adapter`` holds per-expert keys
        (``base_model.model.model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.lora_{A,B}.weight``).
    """
    from transformers import AutoModelForCausalLM

    from lorasync.exporters.fsdp import export

    base_dir = Path(directory) / "base"
    make_tiny_moe_model(base_dir)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = make_moe_peft_model(base, r=r, alpha=alpha, router=router, seed=seed, std=std)
    return MoeCase(base_dir=base_dir, peft_model=model, adapter=export(model, copy=True))
