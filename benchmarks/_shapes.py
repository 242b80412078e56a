"""Model geometry from a HF ``config.json``: which linear modules exist, their shapes, and the
bytes an adapter or a merged update of them moves.

The shipped shapes (``benchmarks/shapes/*.json``) are the geometry fields of the public configs;
``--shape`` also takes any ``config.json`` (or a model directory holding one), so the numbers can
be computed for your own model. Dense Llama/Qwen-style layers and Qwen-MoE-style experts
(``mlp.experts.<e>.{gate,up,down}_proj``) are understood; the MoE router is never a LoRA target.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lorasync.errors import ConfigError

__all__ = [
    "ATTENTION",
    "MLP",
    "SCOPES",
    "VLLM_FUSED",
    "Linear",
    "ModelShape",
    "available_shapes",
    "resolve_scope",
]

SHAPES_DIR = Path(__file__).with_name("shapes")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
SCOPES = {"all-linear": ATTENTION + MLP, "attention": ATTENTION}
# How vLLM stores these leaves: a merged update of one member carries its whole group.
VLLM_FUSED: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Linear:
    """One linear module: HF path, ``in_features``, ``out_features``."""

    path: str
    fan_in: int
    fan_out: int

    @property
    def leaf(self) -> str:
        return self.path.rsplit(".", 1)[-1]


def resolve_scope(scope: str | Sequence[str]) -> tuple[str, ...]:
    """``"all-linear"``, ``"attention"``, ``"q_proj,v_proj"`` or a sequence of leaf names."""
    if isinstance(scope, str):
        if scope in SCOPES:
            return SCOPES[scope]
        leaves = tuple(s.strip() for s in scope.split(",") if s.strip())
    else:
        leaves = tuple(scope)
    unknown = sorted(set(leaves) - set(ATTENTION + MLP))
    if not leaves or unknown:
        raise ConfigError(f"scope {scope!r}: use 'all-linear', 'attention' or leaf names from {list(ATTENTION + MLP)}")
    return leaves


@dataclass(frozen=True)
class ModelShape:
    """The geometry fields of a decoder-only HF config."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    experts: int = 0
    moe_intermediate: int = 0
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()
    qkv_bias: bool = False
    qk_norm: bool = False
    dtype: torch.dtype = torch.bfloat16
    model_type: str = "llama"

    # -- loading ----------------------------------------------------------------------------

    @classmethod
    def load(cls, spec: str | os.PathLike[str]) -> ModelShape:
        """A shipped shape by name (``qwen3-8b``, ``Qwen/Qwen3-8B``), a ``config.json`` path or a
        model directory.

        Raises:
            ConfigError: unknown name, unreadable file, or a config without the geometry fields.
        """
        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            key = str(spec).rsplit("/", 1)[-1].lower().removesuffix(".json")
            path = SHAPES_DIR / f"{key}.json"
            if not path.is_file():
                raise ConfigError(f"unknown shape {str(spec)!r}: pass a config.json path, a model directory or one of {available_shapes()}")
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read model config {path}: {exc}") from exc
        name = path.stem if path.parent == SHAPES_DIR else str(config.get("_name_or_path") or path.parent.name)
        return cls.from_config(config, name=name)

    @classmethod
    def from_config(cls, config: dict, *, name: str) -> ModelShape:
        """From a parsed HF ``config.json``."""
        if "text_config" in config:  # multimodal wrappers keep the decoder geometry here
            config = {**config, **config["text_config"]}
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            experts = int(config.get("num_experts") or config.get("n_routed_experts") or 0)
            model_type = str(config.get("model_type", ""))
            return cls(
                name=name,
                hidden=hidden,
                intermediate=int(config["intermediate_size"]),
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                vocab=int(config["vocab_size"]),
                tied=bool(config.get("tie_word_embeddings", False)),
                experts=experts,
                moe_intermediate=int(config.get("moe_intermediate_size") or config["intermediate_size"]) if experts else 0,
                sparse_step=int(config.get("decoder_sparse_step") or 1),
                dense_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()),
                qkv_bias=bool(config.get("attention_bias", model_type.startswith("qwen2"))),
                qk_norm=model_type.startswith("qwen3"),
                dtype=_DTYPES.get(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), torch.bfloat16),
                model_type=model_type or "llama",
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"model config {name!r} lacks a geometry field ({exc}); it needs hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size") from exc

    def hf_config(self) -> object:
        """A ``transformers`` config of this geometry (to build a model on the meta device)."""
        from transformers import AutoConfig

        fields = dict(
            hidden_size=self.hidden, intermediate_size=self.intermediate, num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, head_dim=self.head_dim, vocab_size=self.vocab, tie_word_embeddings=self.tied,
        )
        if self.experts:
            fields.update(num_experts=self.experts, moe_intermediate_size=self.moe_intermediate, decoder_sparse_step=self.sparse_step, mlp_only_layers=list(self.dense_layers))
        return AutoConfig.for_model(self.model_type, **fields)

    # -- modules ----------------------------------------------------------------------------

    def is_moe_layer(self, layer: int) -> bool:
        return self.experts > 0 and layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0

    def linears(self, scope: str | Sequence[str] = "all-linear", *, layers: Iterable[int] | None = None) -> list[Linear]:
        """The LoRA-targetable linear modules of ``scope`` in ``layers`` (default: all)."""
        leaves = resolve_scope(scope)
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = {"q_proj": (self.hidden, q_out), "k_proj": (self.hidden, kv_out), "v_proj": (self.hidden, kv_out), "o_proj": (q_out, self.hidden)}
        out: list[Linear] = []
        for i in range(self.layers) if layers is None else layers:
            prefix = f"model.layers.{i}"
            for leaf in ATTENTION:
                if leaf in leaves:
                    out.append(Linear(f"{prefix}.self_attn.{leaf}", *attn[leaf]))
            mlp_leaves = [leaf for leaf in MLP if leaf in leaves]
            if not mlp_leaves:
                continue
            if self.is_moe_layer(i):
                inter = self.moe_intermediate
                for e in range(self.experts):
                    out.extend(_mlp(f"{prefix}.mlp.experts.{e}", mlp_leaves, self.hidden, inter))
            else:
                out.extend(_mlp(f"{prefix}.mlp", mlp_leaves, self.hidden, self.intermediate))
        return out

    # -- bytes ------------------------------------------------------------------------------

    def adapter_bytes(self, rank: int, scope: str | Sequence[str] = "all-linear", dtype: torch.dtype = torch.bfloat16, *, layers: Iterable[int] | None = None) -> int:
        """Tensor bytes of a rank-``rank`` adapter: ``r·(in+out)`` elements per module."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(rank * (m.fan_in + m.fan_out) for m in self.linears(scope, layers=layers)) * size

    def merged_bytes(self, scope: str | Sequence[str] = "all-linear", *, fused: Sequence[Sequence[str]] = VLLM_FUSED, layers: Iterable[int] | None = None) -> int:
        """Bytes the merged fallback pushes: every touched weight (``W0 + s·B·A`` in the base
        dtype), plus the untouched members of a touched fused group (an engine stores q/k/v and
        gate/up as one tensor, so the whole group travels)."""
        leaves = set(resolve_scope(scope))
        for group in fused:
            if leaves & set(group):
                leaves |= set(group)
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(m.fan_in * m.fan_out for m in self.linears(tuple(sorted(leaves)), layers=layers)) * size

    def model_bytes(self) -> int:
        """Bytes of the whole model in its dtype (embeddings, linears, norms, biases, routers)."""
        params = self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden  # + final norm
        params += sum(m.fan_in * m.fan_out for m in self.linears("all-linear"))
        per_layer = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        if self.qkv_bias:
            per_layer += (self.heads + 2 * self.kv_heads) * self.head_dim
        params += per_layer * self.layers
        params += sum(self.hidden * self.experts for i in range(self.layers) if self.is_moe_layer(i))
        return params * torch.empty((), dtype=self.dtype).element_size()


def _mlp(prefix: str, leaves: Sequence[str], hidden: int, inter: int) -> list[Linear]:
    dims = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    return [Linear(f"{prefix}.{leaf}", *dims[leaf]) for leaf in leaves]


def available_shapes() -> list[str]:
    """Names of the shipped shapes."""
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))
