"""Gathered Megatron adapter factors → PEFT tensors, and the final :class:`Adapter`.

Runs after the TP/EP gather: trims max-rank padding, splits fused ``linear_out`` tensors per HF
projection, duplicates the shared ``linear_in`` (exact: ``[B_q; B_k; B_v] · A`` is what Megatron
computes) and expands grouped expert adapters to one module per expert. Every output tensor is
its own contiguous copy, so duplicates never share storage (safetensors refuses shared tensors).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lorasync.adapter._adapter import Adapter
from lorasync.adapter._config import AdapterConfig
from lorasync.adapter._keys import peft_key
from lorasync.errors import GeometryError
from lorasync.exporters.megatron._layout import Geometry, split_fc1, split_qkv
from lorasync.exporters.megatron._plan import ModulePlan
from lorasync.exporters._rank import trim_tensor

__all__ = ["build_adapter", "convert_module"]

Pair = tuple[torch.Tensor, torch.Tensor]


def _own(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").clone(memory_format=torch.contiguous_format)


def convert_module(
    plan: ModulePlan, a: torch.Tensor, b: torch.Tensor, *, geometry: Geometry, rank: int | None
) -> dict[str, Pair]:
    """Turn one gathered Megatron adapter into ``{hf_module: (lora_A, lora_B)}``.

    Raises:
        PaddedRankError: padding beyond ``rank`` holds non-zero values.
    """
    if rank is not None:
        a = trim_tensor(a, "A", rank, name=plan.hf[0])
        b = trim_tensor(b, "B", rank, name=plan.hf[0])
    pieces: tuple[torch.Tensor, ...]
    if plan.sub is None and plan.rule.fused == "qkv":
        pieces = split_qkv(b, geometry)
    elif plan.sub is None and plan.rule.fused == "fc1":
        pieces = split_fc1(b, plan.b.tp_size)  # one [gate; up] block per (expert-)TP rank
    else:
        pieces = (b,)
    out: dict[str, Pair] = {}
    if plan.rule.experts == "grouped":
        for expert in range(geometry.experts):
            a_e = a[expert] if a.dim() == 3 else a
            for template, piece in zip(plan.hf, pieces):
                b_e = piece[expert] if piece.dim() == 3 else piece
                out[template.replace("{E}", str(expert))] = (_own(a_e), _own(b_e))
    else:
        for module, piece in zip(plan.hf, pieces):
            out[module] = (_own(a), _own(piece))
    return out


def build_adapter(
    modules: Mapping[str, Pair],
    *,
    rank: int | None,
    alpha: float,
    dtype: torch.dtype | None = None,
    base_model_name_or_path: str | None = None,
) -> Adapter:
    """The Adapter for converted modules: ``r`` = ``rank`` (or the widest module), modules of
    another width in ``rank_pattern``, ``lora_alpha`` = ``alpha``, no rsLoRA (Megatron-Bridge
    scales by ``alpha / dim``, which is PEFT's ``lora_alpha / r``).

    Raises:
        GeometryError: ``rank`` exceeds every exported module's width.
    """
    widths = {m: pair[0].shape[0] for m, pair in modules.items()}
    r = rank if rank is not None else max(widths.values())
    if rank is not None and rank > max(widths.values()):
        raise GeometryError(
            f"rank={rank} exceeds the exported adapters' width {max(widths.values())}; pass the trained rank"
        )
    tensors: dict[str, torch.Tensor] = {}
    for module, (a, b) in modules.items():
        tensors[peft_key(module, "A")] = a if dtype is None else a.to(dtype)
        tensors[peft_key(module, "B")] = b if dtype is None else b.to(dtype)
    config = AdapterConfig(
        r=r,
        lora_alpha=alpha,
        rank_pattern={m: w for m, w in widths.items() if w != r},
        base_model_name_or_path=base_model_name_or_path,
    )
    return Adapter(tensors, config)
