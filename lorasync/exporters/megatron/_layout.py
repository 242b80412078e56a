"""Megatron tensor layouts: model geometry from an HF ``config.json``, pipeline layer offsets,
and the fused-tensor splits (QKV de-interleave, per-TP-rank gate/up).

The formulas follow trainer-formats.md §1.3 and §1.4: fused QKV rows are grouped per query
group as ``[q_0 .. q_{hpg-1}, k, v]`` heads of ``head_dim`` rows each, and a TP-gathered fc1
``linear_out`` is ``[gate_0; up_0; gate_1; up_1; ...]`` (one ``[gate; up]`` block per TP rank).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lorasync.errors import ConfigError, GeometryError, StorageError
from lorasync.exporters.megatron._names import ModuleRule

__all__ = ["Geometry", "factor_dims", "split_fc1", "split_qkv", "stage_offsets"]

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
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    elif callable(getattr(config, "to_dict", None)):  # transformers PretrainedConfig
        data = config.to_dict()
    else:
        raise ConfigError(f"base_config must be a path, a directory or a dict, got {type(config).__name__}")
    if "hidden_size" not in data and isinstance(data.get("text_config"), Mapping):
        data = data["text_config"]  # multimodal wrappers keep the LM geometry here
    return data


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
        try:
            hidden = int(data["hidden_size"])
            heads = int(data["num_attention_heads"])
            layers = int(data["num_hidden_layers"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"base config lacks {exc}; it needs hidden_size, num_attention_heads and num_hidden_layers"
            ) from exc
        kv_heads = int(data.get("num_key_value_heads") or heads)
        head_dim = int(data.get("head_dim") or (hidden // heads if heads else 0))
        experts = next((int(data[k]) for k in _EXPERT_COUNT_KEYS if data.get(k)), 0)
        intermediate = int(data.get("intermediate_size") or 0)
        expert_intermediate = int(data.get("moe_intermediate_size") or intermediate) if experts else 0
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

    Args:
        num_layers (`int`): decoder layers of the base model.
        pp_size, vp_size (`int`): pipeline and virtual-pipeline sizes.
        layer_offsets: None for Megatron's even split
            (``vp * (L // vp_size) + pp * (L // pp_size // vp_size)``); a sequence indexed by PP
            rank; or a mapping from ``pp`` or ``(pp, vp)`` to the offset (uneven stages, custom
            layouts).

    Raises:
        GeometryError: an even split is impossible, or offsets are missing for a stage.
    """
    stages = [(p, v) for p in range(pp_size) for v in range(vp_size)]
    if layer_offsets is None:
        chunks = pp_size * vp_size
        if num_layers % chunks:
            raise GeometryError(
                f"{num_layers} layers do not split evenly over PP={pp_size} x VPP={vp_size}; "
                "pass layer_offsets= with each stage's first global layer"
            )
        return {(p, v): v * (num_layers // vp_size) + p * (num_layers // chunks) for p, v in stages}
    offsets: dict[tuple[int, int], int] = {}
    if isinstance(layer_offsets, Mapping):
        for key, value in layer_offsets.items():
            stage = (int(key), 0) if isinstance(key, int) else (int(key[0]), int(key[1]))
            offsets[stage] = int(value)
    else:
        if vp_size != 1:
            raise ConfigError("with virtual pipeline stages, layer_offsets must map (pp, vp) to an offset")
        offsets = {(p, 0): int(o) for p, o in enumerate(layer_offsets)}
    missing = [s for s in stages if s not in offsets]
    if missing:
        raise GeometryError(f"layer_offsets has no offset for (pp, vp) stages {missing}")
    return {s: offsets[s] for s in stages}
