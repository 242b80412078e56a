"""Synthetic adapters and base weights of a given model shape (values random, sizes exact)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from benchmarks._shapes import VLLM_FUSED, ModelShape, resolve_scope
from lorasync import Adapter, AdapterConfig
from lorasync._keys import peft_key

__all__ = ["synth_adapter", "synth_base_dir", "synth_base_tensors"]


def synth_adapter(
    shape: ModelShape,
    *,
    rank: int,
    scope: str | Sequence[str] = "all-linear",
    dtype: torch.dtype = torch.bfloat16,
    layers: Iterable[int] | None = None,
    seed: int = 0,
) -> Adapter:
    """A rank-``rank`` adapter over ``shape``'s ``scope`` modules, filled with small random values."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for m in shape.linears(scope, layers=layers):
        tensors[peft_key(m.path, "A")] = _randn((rank, m.fan_in), dtype, gen)
        tensors[peft_key(m.path, "B")] = _randn((m.fan_out, rank), dtype, gen)
    config = AdapterConfig(r=rank, lora_alpha=2 * rank, target_modules=resolve_scope(scope), base_model_name_or_path=shape.name)
    return Adapter(tensors, config)


def _randn(size: tuple[int, int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.empty(size, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(dtype)


def _base_names(shape: ModelShape, scope: str | Sequence[str], layers: Iterable[int] | None, fused: Sequence[Sequence[str]]) -> list[tuple[str, int, int]]:
    leaves = set(resolve_scope(scope))
    for group in fused:
        if leaves & set(group):
            leaves |= set(group)
    return [(f"{m.path}.weight", m.fan_out, m.fan_in) for m in shape.linears(tuple(sorted(leaves)), layers=layers)]


def synth_base_tensors(shape: ModelShape, *, scope: str | Sequence[str] = "all-linear", layers: Iterable[int] | None = None, fused: Sequence[Sequence[str]] = VLLM_FUSED) -> dict[str, torch.Tensor]:
    """In-memory base weights (zeros, lazily paged in) for the modules a merge of ``scope`` touches."""
    return {name: torch.zeros(out, inp, dtype=shape.dtype) for name, out, inp in _base_names(shape, scope, layers, fused)}


def synth_base_dir(
    shape: ModelShape,
    directory: str | Path,
    *,
    scope: str | Sequence[str] = "all-linear",
    layers: Iterable[int] | None = None,
    fused: Sequence[Sequence[str]] = VLLM_FUSED,
    seed: int = 0,
) -> Path:
    """A sharded safetensors checkpoint (one shard per layer, with an index) holding the touched
    modules of ``layers``; written one layer at a time so building it needs one layer of memory."""
    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    by_layer: dict[str, list[tuple[str, int, int]]] = {}
    for name, out, inp in _base_names(shape, scope, layers, fused):
        by_layer.setdefault(name.split(".")[2], []).append((name, out, inp))
    weight_map: dict[str, str] = {}
    for layer, entries in by_layer.items():
        shard = f"layer-{int(layer):05d}.safetensors"
        save_file({n: torch.empty(o, i, dtype=shape.dtype).normal_(0.0, 0.02, generator=gen) for n, o, i in entries}, str(path / shard))
        weight_map.update({n: shard for n, _, _ in entries})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path
