"""Helpers shared by the GPU tests and their consumer process."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from lorasync import Adapter, AdapterConfig


def digest(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Per-tensor SHA-256 of dtype, shape and bytes."""
    out = {}
    for key, t in sorted(tensors.items()):
        cpu = t.detach().to("cpu").contiguous()
        h = hashlib.sha256(f"{cpu.dtype}{tuple(cpu.shape)}".encode())
        h.update(cpu.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[key] = h.hexdigest()
    return out


def adapter_on_gpu(layers: int = 3, hidden: int = 256, inter: int = 512, r: int = 8, seed: int = 0) -> Adapter:
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (hidden // 4, hidden),
        "self_attn.v_proj": (hidden // 4, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    tensors = {}
    for i in range(layers):
        for name, (out, inp) in shapes.items():
            m = f"base_model.model.model.layers.{i}.{name}"
            tensors[f"{m}.lora_A.weight"] = torch.randn(r, inp, device="cuda", generator=g).to(torch.bfloat16)
            tensors[f"{m}.lora_B.weight"] = torch.randn(out, r, device="cuda", generator=g).to(torch.bfloat16)
    return Adapter(tensors, AdapterConfig(r=r, lora_alpha=2 * r))
