"""Small adapters for tests whose content depends on a seed."""

from __future__ import annotations

import torch

from lorasync import Adapter, AdapterConfig

MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.down_proj")


def tiny_adapter(seed: int, *, r: int = 4, width: int = 16) -> Adapter:
    """A small adapter whose content depends on ``seed`` (distinct hash per seed)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module in MODULES:
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, width, generator=gen)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(width, r, generator=gen)
    return Adapter(tensors, AdapterConfig(r=r, lora_alpha=2.0 * r))
