"""Adapter-to-Adapter transforms: rank trimming, rank padding, engine-safe scaling and completing
MoE experts.

Exporters trim; users (or engine clients) pad and normalize before an engine that needs it.
Every transform leaves ``B·A·scale`` unchanged, so a transformed adapter serves exactly the
trained weights. Re-exported by :mod:`lorasync.exporters` (``trim_rank``, ``trim_tensor``,
``normalize_scaling``) and :mod:`lorasync.engines.sglang` (``pad_ranks``), where they were first.

Multi-LoRA trainers allocate every slot at a max rank and zero the unused rows of A and columns
of B. ``trim_rank`` slices them off (A on dim -2, B on dim -1, so packed ``[E, r, in]`` expert
tensors work too) after proving they are exactly zero. ``normalize_scaling`` folds per-module
scale differences into lora_B so one global ``lora_alpha / r`` is exact on every engine.
``complete_experts`` gives every expert of a layer with expert LoRA all three projections (zero
LoRA where the trainer had none), as vLLM's MoE packing requires.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import torch

from lorasync.adapter._adapter import Adapter
from lorasync.adapter._config import AdapterConfig
from lorasync.adapter._keys import parse_peft_key
from lorasync.adapter._moe import LAYOUT, expert_module, group_experts
from lorasync.errors import ConfigError, PaddedRankError, ShapeMismatchError

__all__ = ["complete_experts", "normalize_scaling", "pad_ranks", "trim_rank", "trim_tensor"]


def trim_tensor(tensor: torch.Tensor, side: str, rank: int, *, name: str = "") -> torch.Tensor:
    """Slice one LoRA factor to ``rank`` (A: dim -2, B: dim -1).

    Returns the tensor unchanged when it is already at most ``rank`` wide.

    Raises:
        PaddedRankError: the discarded part is not exactly zero (names the module and the
            largest absolute value found there).
    """
    if rank <= 0:
        raise ShapeMismatchError(f"{name}: rank must be positive, got {rank}", key=name)
    dim = tensor.dim() - 2 if side == "A" else tensor.dim() - 1
    if tensor.dim() < 2:
        raise ShapeMismatchError(f"{name}: LoRA factor must be at least 2-D, got {tuple(tensor.shape)}", key=name)
    size = tensor.shape[dim]
    if size <= rank:
        return tensor
    padding = tensor.narrow(dim, rank, size - rank)
    # Explicit check, not assert: it must hold under `python -O`. (An empty slice pads nothing.)
    largest = padding.detach().abs().max() if padding.numel() else torch.zeros(())
    if not bool(largest == 0):
        raise PaddedRankError(
            f"{name}: lora_{side} padding beyond rank {rank} is not zero (max |value| = "
            f"{float(largest):.6g}); the slot was trained past its rank, so trimming would drop "
            "signal. Check the rank you export with, or the trainer's rank mask.",
            key=name,
            max_abs=float(largest),
        )
    return tensor.narrow(dim, 0, rank)


def trim_rank(
    tensors: Mapping[str, torch.Tensor], rank: int | Mapping[str, int]
) -> dict[str, torch.Tensor]:
    """Trim max-rank padding from PEFT-keyed tensors.

    Args:
        tensors (`Mapping[str, torch.Tensor]`): PEFT keys to (possibly padded) factors.
        rank (`int` or `Mapping[str, int]`): the real rank, globally or per module path.

    Returns:
        `dict[str, torch.Tensor]`: the same keys, trimmed (views, no copies).

    Raises:
        PaddedRankError: non-zero padding.
        ConfigError: a per-module ``rank`` mapping lacks one of the modules.
    """
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        module, side = parse_peft_key(key)
        if isinstance(rank, int):
            r = rank
        elif module in rank:
            r = rank[module]
        else:
            raise ConfigError(
                f"no rank given for {module}; the rank mapping must cover every exported module "
                f"(it has {len(rank)} entries), or pass one int",
                key=key,
            )
        out[key] = trim_tensor(tensor, side, r, name=module)
    return out


def normalize_scaling(adapter: Adapter) -> Adapter:
    """Fold per-module scales into lora_B so a single global scale is exact everywhere.

    PEFT honours ``rank_pattern``/``alpha_pattern``/``use_rslora``; vLLM applies one
    ``lora_alpha / r`` (or rsLoRA) scale and SGLang ignores all three. The result has
    ``use_rslora=False`` and one global scale ``g = lora_alpha / r`` on every module: modules
    whose rank differs get ``rank_pattern[m] = r_m`` (PEFT needs it to build the right shapes)
    and ``alpha_pattern[m] = g · r_m``. ``g`` is the scale most modules already have, so only
    modules whose scale differs get ``B_m · scale_m / g`` (rescaling rounds each element of B
    in its dtype; an all-rsLoRA adapter keeps B bit for bit). ΔW is unchanged under PEFT and
    every engine.

    Args:
        adapter (`Adapter`): any adapter; returned as is when already engine-safe.

    Returns:
        `Adapter`: an adapter with ``engine_safe_scaling`` true.
    """
    config = adapter.config
    if adapter.engine_safe_scaling:
        return adapter
    ranks = {m: config.rank_for(m) for m in adapter.modules}
    scales = {m: config.scale_for(m) for m in adapter.modules}
    r = max(ranks.values())
    # Modules are sorted, so ties between equally common scales resolve deterministically.
    common = Counter(scales.values()).most_common(1)[0][0]
    # g · r_m / r_m must give back g exactly; 1.0 always does (alpha_m = r_m).
    new_config = _uniform_config(config, ranks, r, common) or _uniform_config(config, ranks, r, 1.0)
    assert new_config is not None  # scale 1 is exact by construction
    scale = new_config.global_scale
    tensors: dict[str, torch.Tensor] = {}
    for module in adapter.modules:
        a, b = adapter.pair(module)
        tensors[adapter.key(module, "A")] = a
        if scales[module] != scale:
            b = (b.double() * (scales[module] / scale)).to(b.dtype)
        tensors[adapter.key(module, "B")] = b
    return Adapter(tensors, new_config)


def pad_ranks(adapter: Adapter) -> Adapter:
    """An equivalent adapter whose every module has rank ``max(r_m)`` (zero rows/columns added).

    SGLang ignores ``rank_pattern`` and sizes every module at the config's ``r``; padding A with
    zero rows and B with zero columns leaves ``B·A`` unchanged, and the config is rewritten so
    ``lora_alpha / r`` keeps the adapter's global scale. Only exact for adapters with
    ``engine_safe_scaling`` (run :func:`normalize_scaling` first).

    Args:
        adapter (`Adapter`): the adapter to pad.

    Returns:
        `Adapter`: ``adapter`` itself when its ranks are already uniform, else a padded copy.
    """
    ranks = {m: adapter.pair(m)[0].shape[0] for m in adapter.modules}
    r = max(ranks.values())
    config = adapter.config
    if all(rank == config.r for rank in ranks.values()) and not config.rank_pattern:
        return adapter
    tensors: dict[str, torch.Tensor] = {}
    for module in adapter.modules:
        a, b = adapter.pair(module)
        extra = r - a.shape[0]
        if extra:
            a = torch.cat([a, a.new_zeros(extra, a.shape[1])], dim=0)
            b = torch.cat([b, b.new_zeros(b.shape[0], extra)], dim=1)
        tensors[adapter.key(module, "A")] = a
        tensors[adapter.key(module, "B")] = b
    new_config = AdapterConfig(
        r=r,
        lora_alpha=config.global_scale * r,
        target_modules=config.target_modules,
        base_model_name_or_path=config.base_model_name_or_path,
    )
    return Adapter(tensors, new_config)


def _uniform_config(config: AdapterConfig, ranks: Mapping[str, int], r: int, scale: float) -> AdapterConfig | None:
    """A config whose every module has exactly ``scale`` (PEFT's alpha/r), or None when float
    rounding makes some ``alpha_m / r_m`` miss it."""
    odd = {m: rank for m, rank in ranks.items() if rank != r}
    candidate = AdapterConfig(
        r=r,
        lora_alpha=scale * r,
        target_modules=config.target_modules,
        base_model_name_or_path=config.base_model_name_or_path,
        rank_pattern=odd,
        alpha_pattern={m: scale * rank for m, rank in odd.items()},
    )
    exact = candidate.global_scale == scale and all(candidate.scale_for(m) == scale for m in ranks)
    return candidate if exact else None


def complete_experts(adapter: Adapter) -> Adapter:
    """An equivalent adapter in which every expert ``0..E-1`` of a layer with expert LoRA has
    ``gate_proj``, ``up_proj`` and ``down_proj`` factors (``E``: one past the highest expert the
    layer's LoRA names): the missing ones are zero, so every ``B·A`` is unchanged.

    vLLM 0.32 packs a layer's expert LoRA only complete; PEFT ``target_parameters`` LoRA on
    ``gate_up_proj`` alone, for one, exports without ``down_proj``.

    Args:
        adapter (`Adapter`): any adapter; returned as is when nothing is missing.

    Returns:
        `Adapter`: the completed adapter (same config: each added module gets the rank the config
        gives it).
    """
    leaves = [leaf for rule in LAYOUT for leaf in rule.leaves]
    layers: dict[str, dict[tuple[int, str], str]] = {}
    for path, members in group_experts(adapter.modules).items():
        layers.setdefault(path.rsplit(".", 1)[0], {}).update(members)
    tensors = dict(adapter.tensors)
    for owner, members in layers.items():
        hidden = inter = 0
        for (_, leaf), module in members.items():
            a, b = adapter.pair(module)
            hidden, inter = (b.shape[0], a.shape[1]) if leaf == "down_proj" else (a.shape[1], b.shape[0])
        dtype = adapter.dtype
        for expert in range(1 + max(e for e, _ in members)):
            for leaf in leaves:
                if (expert, leaf) in members:
                    continue
                module = expert_module(owner, expert, leaf)
                rank = adapter.config.rank_for(module)
                fan_in, fan_out = (inter, hidden) if leaf == "down_proj" else (hidden, inter)
                tensors[adapter.key(module, "A")] = torch.zeros(rank, fan_in, dtype=dtype)
                tensors[adapter.key(module, "B")] = torch.zeros(fan_out, rank, dtype=dtype)
    if len(tensors) == len(adapter.tensors):
        return adapter
    return Adapter(tensors, adapter.config.with_(target_modules=()))
