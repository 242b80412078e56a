"""Megatron tensor layouts: model geometry from an HF ``config.json``, pipeline layer offsets,
and the fused-tensor splits (QKV de-interleave, per-TP-rank gate/up).

The formulas follow trainer-formats.md §1.3 and §1.4: fused QKV rows are grouped per query
group as ``[q_0 .. q_{hpg-1}, k, v]`` heads of ``head_dim`` rows each, and a TP-gathered fc1
``linear_out`` is ``[gate_0; up_0; gate_1; up_1; ...]`` (one ``[gate; up]`` block per TP rank).
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lorasync.errors import ConfigError, GeometryError, StorageError
from lorasync.exporters.megatron._names import ModuleRule

__all__ = ["Geometry", "factor_dims", "split_fc1", "split_qkv", "stage_bounds", "stage_offsets"]

_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _load_config(config: str | os.PathLike[str] | Mapping[str, Any] | Any) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        data: Mapping[str, Any] = config
    elif isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise StorageError(f"cannot read base config {path}: {exc}; pass the base model's config.json") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}; pass the base model's config.json") from exc
    elif callable(getattr(config, "to_dict", None)):  # transformers PretrainedConfig
        data = config.to_dict()
    else:
        raise ConfigError(f"base_config must be a path, a directory or a dict, got {type(config).__name__}")
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"base config must be a JSON object (the base model's config.json), got a {type(data).__name__}"
        )
    if "hidden_size" not in data and isinstance(data.get("text_config"), Mapping):
        data = data["text_config"]  # multimodal wrappers keep the LM geometry here
    return data


def _size(data: Mapping[str, Any], key: str) -> int:
    """An integer field of the config (0 when absent or null); bools and strings are refused."""
    value = data.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"base config field {key} must be an int, got {value!r}; check the base model's config.json")
    return int(value)


@dataclass(frozen=True)
class Geometry:
    """The sizes an export needs, in HF terms (heads, KV heads = Megatron query groups, ...)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    experts: int = 0
    expert_intermediate: int = 0
    model_type: str = ""

    @classmethod
    def from_config(cls, config: str | os.PathLike[str] | Mapping[str, Any] | Any) -> Geometry:
        """Read the geometry from an HF ``config.json`` (path, directory or dict).

        Raises:
            StorageError: the file cannot be read.
            ConfigError: a required field is missing.
            GeometryError: head counts that do not divide.
        """
        data = _load_config(config)
        missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers") if data.get(k) is None]
        if missing:
            raise ConfigError(
                f"base config lacks {missing}; it needs hidden_size, num_attention_heads and num_hidden_layers"
            )
        hidden, heads, layers = (_size(data, k) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers"))
        kv_heads = _size(data, "num_key_value_heads") or heads
        head_dim = _size(data, "head_dim") or (hidden // heads if heads else 0)
        experts = next((_size(data, k) for k in _EXPERT_COUNT_KEYS if data.get(k)), 0)
        intermediate = _size(data, "intermediate_size")
        expert_intermediate = (_size(data, "moe_intermediate_size") or intermediate) if experts else 0
        geometry = cls(
            hidden, heads, kv_heads, head_dim, intermediate, layers, experts, expert_intermediate,
            str(data.get("model_type") or ""),
        )
        geometry._validate()
        return geometry

    def _validate(self) -> None:
        if min(self.hidden, self.heads, self.kv_heads, self.head_dim, self.layers) <= 0:
            raise GeometryError(f"base config has non-positive sizes: {self}")
        if self.heads % self.kv_heads:
            raise GeometryError(
                f"num_attention_heads={self.heads} is not a multiple of num_key_value_heads="
                f"{self.kv_heads}; check the base config"
            )

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def q_out(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_out(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def qkv_out(self) -> int:
        return self.q_out + 2 * self.kv_out

    def check_tp(self, tp: int) -> None:
        """Megatron requires the attention heads to split evenly over TP.

        Raises:
            GeometryError: naming both numbers.
        """
        if self.heads % tp:
            raise GeometryError(
                f"TP={tp} does not divide num_attention_heads={self.heads}; these shards were not "
                "produced for this base model, or a TP rank is missing (pass tp_size= to check)"
            )


def factor_dims(rule: ModuleRule, sub: str | None, geometry: Geometry) -> tuple[int, int]:
    """``(in_features of A, out_features of B)`` of a gathered adapter for ``geometry``."""
    g = geometry
    leaf = rule.megatron.rsplit(".", 1)[-1]
    expert = rule.experts is not None
    inter = g.expert_intermediate if expert else g.intermediate
    if leaf == "linear_qkv":
        return g.hidden, {None: g.qkv_out, "adapter_q": g.q_out}.get(sub, g.kv_out)
    if leaf == "linear_proj":
        return g.q_out, g.hidden
    if leaf == "linear_fc1":
        return g.hidden, inter if sub else 2 * inter
    if leaf == "linear_fc2":
        return inter, g.hidden
    if leaf == "router":
        return g.hidden, g.experts
    raise AssertionError(f"factor_dims has no entry for rule {rule.megatron}")  # RULES and this must agree


def split_qkv(b: torch.Tensor, geometry: Geometry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """De-interleave a gathered fused-QKV ``linear_out`` ``[qkv_out, r]`` into q, k, v."""
    g = geometry
    hpg = g.heads_per_group
    x = b.reshape(g.kv_heads, hpg + 2, g.head_dim, b.shape[-1])
    q = x[:, :hpg].reshape(g.q_out, -1)
    k = x[:, hpg].reshape(g.kv_out, -1)
    v = x[:, hpg + 1].reshape(g.kv_out, -1)
    return q, k, v


def split_fc1(b: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a gathered fc1 ``linear_out`` ``[..., 2I, r]`` made of ``parts`` per-TP-rank
    ``[gate; up]`` blocks into gate ``[..., I, r]`` and up ``[..., I, r]``."""
    *lead, rows, r = b.shape
    x = b.reshape(*lead, parts, 2, rows // (2 * parts), r)
    gate = x[..., 0, :, :].reshape(*lead, rows // 2, r)
    up = x[..., 1, :, :].reshape(*lead, rows // 2, r)
    return gate, up


def stage_offsets(
    num_layers: int,
    pp_size: int,
    vp_size: int,
    layer_offsets: Sequence[int] | Mapping[Any, int] | None,
) -> dict[tuple[int, int], int]:
    """Global index of local layer 0 for every ``(pp_rank, vp_stage)``.

    Megatron numbers the layers of its model chunks in pipeline order: chunk ``vp`` of PP ranks
    0, 1, ... comes before chunk ``vp + 1``. Given offsets must follow that order, start at 0 and
    stay within the model, so that the stages partition the layers: each stage holds the layers
    from its offset up to the next stage's (a stage whose offset equals the next one's is empty,
    as in Megatron layouts whose first or last stage holds only the embedding or the loss).

    Args:
        num_layers (`int`): decoder layers of the base model.
        pp_size, vp_size (`int`): pipeline and virtual-pipeline sizes.
        layer_offsets: None for Megatron's even split
            (``vp * (L // vp_size) + pp * (L // pp_size // vp_size)``); a sequence indexed by PP
            rank; or a mapping from ``pp`` or ``(pp, vp)`` to the offset (uneven stages, custom
            layouts).

    Raises:
        GeometryError: an even split is impossible; offsets are missing for a stage or given for
            one outside the grid; offsets out of pipeline order, not starting at 0 or beyond the
            model.
        ConfigError: offsets that are not non-negative ints, or keys of the wrong form.
    """
    stages = [(p, v) for p in range(pp_size) for v in range(vp_size)]
    chunks = pp_size * vp_size
    even = num_layers % chunks == 0
    if layer_offsets is None:
        if not even:
            raise GeometryError(
                f"{num_layers} layers do not split evenly over PP={pp_size} x VPP={vp_size}; "
                "pass layer_offsets= with each stage's first global layer"
            )
        return {(p, v): v * (num_layers // vp_size) + p * (num_layers // chunks) for p, v in stages}
    offsets = _given_offsets(layer_offsets, pp_size, vp_size)
    missing = [s for s in stages if s not in offsets]
    if missing:
        raise GeometryError(f"layer_offsets has no offset for (pp, vp) stages {missing}")
    outside = sorted(s for s in offsets if s not in stages)
    if outside:
        raise GeometryError(
            f"layer_offsets gives offsets for (pp, vp) stages {outside}, but the shards span PP={pp_size} "
            f"x VPP={vp_size}; pass one offset per stage (or pp_size= if a stage's shards are missing)"
        )
    order = sorted(stages, key=lambda s: (s[1], s[0]))  # Megatron's chunk order: vp-major
    starts = [offsets[s] for s in order]
    bad = starts[0] != 0 or starts[-1] > num_layers or any(a > b for a, b in zip(starts, starts[1:]))
    if bad:
        given = [offsets[(p, 0)] for p in range(pp_size)] if vp_size == 1 else dict(zip(order, starts))
        hint = "e.g. [0, 3] for 5 layers split 3+2 over PP=2"
        if even:
            split = stage_offsets(num_layers, pp_size, vp_size, None)
            shown = [split[(p, 0)] for p in range(pp_size)] if vp_size == 1 else split
            hint = f"the even split is {shown} (or leave layer_offsets out)"
        raise GeometryError(
            f"layer_offsets {given} do not partition the base model's {num_layers} layers in pipeline "
            "order: the first stage must start at layer 0 and each later stage ((pp 1, vp 0), ..., then "
            f"the stages of vp 1) at or after the one before, at most at {num_layers}; pass each stage's "
            f"first global layer in that order, {hint}"
        )
    return {s: offsets[s] for s in stages}


def stage_bounds(
    num_layers: int, pp_size: int, vp_size: int, layer_offsets: Sequence[int] | Mapping[Any, int] | None
) -> dict[tuple[int, int], range]:
    """The global layers each ``(pp_rank, vp_stage)`` holds: from its offset to the next stage's
    in pipeline order (the last up to ``num_layers``). The ranges partition the model's layers.

    Raises:
        GeometryError, ConfigError: as :func:`stage_offsets`.
    """
    offsets = stage_offsets(num_layers, pp_size, vp_size, layer_offsets)
    order = sorted(offsets, key=lambda s: (s[1], s[0]))
    stops = [offsets[s] for s in order[1:]] + [num_layers]
    return {s: range(offsets[s], stop) for s, stop in zip(order, stops)}


def _offset(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise ConfigError(f"layer_offsets{where} must be a non-negative int (a global layer index), got {value!r}")
    return int(value)


def _given_offsets(
    layer_offsets: Sequence[int] | Mapping[Any, int], pp_size: int, vp_size: int
) -> dict[tuple[int, int], int]:
    offsets: dict[tuple[int, int], int] = {}
    if isinstance(layer_offsets, Mapping):
        for key, value in layer_offsets.items():
            if isinstance(key, numbers.Integral) and not isinstance(key, bool):
                stage = (int(key), 0)
            elif isinstance(key, tuple) and len(key) == 2:
                stage = (_offset(key[0], f" key {key!r}"), _offset(key[1], f" key {key!r}"))
            else:
                raise ConfigError(f"layer_offsets keys must be a PP rank or a (pp, vp) tuple of ints, got {key!r}")
            if stage in offsets:
                raise ConfigError(f"layer_offsets gives stage (pp, vp)={stage} twice; give each stage once")
            offsets[stage] = _offset(value, f"[{key!r}]")
        return offsets
    if isinstance(layer_offsets, (str, bytes)) or not isinstance(layer_offsets, Iterable):
        raise ConfigError(
            f"layer_offsets must be a list of ints indexed by PP rank or a mapping, got {layer_offsets!r}"
        )
    if vp_size != 1:
        raise ConfigError("with virtual pipeline stages, layer_offsets must map (pp, vp) to an offset")
    values = list(layer_offsets)
    if len(values) != pp_size:
        raise GeometryError(
            f"layer_offsets gives {len(values)} offset(s) but the shards span PP={pp_size}; pass one offset per "
            "PP rank (or pp_size= if a stage's shards are missing)"
        )
    return {(p, 0): _offset(o, f"[{p}]") for p, o in enumerate(values)}
