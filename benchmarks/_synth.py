"""Synthetic adapters and base weights of a given model shape (values random, sizes exact)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from benchmarks._shapes import VLLM_FUSED, ModelShape, resolve_scope
from lorasync import Adapter, AdapterConfig
from lorasync.adapter._keys import peft_key

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
    with _one_thread():
        return _synth_adapter(shape, rank=rank, scope=scope, dtype=dtype, layers=layers, seed=seed)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Many small copies run far faster on one intra-op thread (no OpenMP hand-offs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _synth_adapter(shape: ModelShape, *, rank: int, scope: str | Sequence[str], dtype: torch.dtype, layers: Iterable[int] | None, seed: int) -> Adapter:
    gen = torch.Generator().manual_seed(seed)
    pool = torch.empty(_POOL, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(dtype)
    tensors: dict[str, torch.Tensor] = {}
    for i, m in enumerate(shape.linears(scope, layers=layers)):
        tensors[peft_key(m.path, "A")] = _from_pool(pool, (rank, m.fan_in), 2 * i)
        tensors[peft_key(m.path, "B")] = _from_pool(pool, (m.fan_out, rank), 2 * i + 1)
    config = AdapterConfig(r=rank, lora_alpha=2 * rank, target_modules=resolve_scope(scope), base_model_name_or_path=shape.name)
    return Adapter(tensors, config)


_POOL = (1 << 20) + 7  # random values tiled into tensors: fast, and no two tensors alike


def _from_pool(pool: torch.Tensor, size: tuple[int, int], index: int) -> torch.Tensor:
    """A fresh tensor of ``size`` filled from ``pool`` at an offset that depends on ``index``."""
    numel = size[0] * size[1]
    start = (index * 7919) % pool.numel()
    out = torch.empty(numel, dtype=pool.dtype)
    done = 0
    while done < numel:
        n = min(numel - done, pool.numel() - start)
        out[done : done + n] = pool[start : start + n]
        done, start = done + n, 0
    return out.reshape(size)


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
    pool = torch.empty(_POOL, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(shape.dtype)
    by_layer: dict[str, list[tuple[str, int, int]]] = {}
    for name, out, inp in _base_names(shape, scope, layers, fused):
        by_layer.setdefault(name.split(".")[2], []).append((name, out, inp))
    weight_map: dict[str, str] = {}
    for layer, entries in by_layer.items():
        shard = f"layer-{int(layer):05d}.safetensors"
        with _one_thread():
            tensors = {n: _from_pool(pool, (o, i), k) for k, (n, o, i) in enumerate(entries)}
        save_file(tensors, str(path / shard))
        del tensors
        weight_map.update({n: shard for n, _, _ in entries})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path
