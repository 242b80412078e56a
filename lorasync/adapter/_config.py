"""AdapterConfig: the one source of truth for an adapter's LoRA hyper-parameters.

It maps one-to-one onto PEFT's ``LoraConfig`` (which writes ``adapter_config.json``), and knows
each module's effective rank and scale the way PEFT computes them (rank/alpha patterns, rsLoRA).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from lorasync.errors import ConfigError

__all__ = ["AdapterConfig"]


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    # Insertion order is kept: PEFT resolves rank/alpha patterns first-match in that order.
    return MappingProxyType(dict((mapping or {}).items()))


@dataclass(frozen=True)
class AdapterConfig:
    """LoRA hyper-parameters of one adapter (what ``adapter_config.json`` holds)."""

    r: int = field(metadata={"help": "Default LoRA rank (PEFT `r`)."})
    lora_alpha: float = field(metadata={"help": "Default alpha; scale is alpha/r (or alpha/sqrt(r))."})
    target_modules: tuple[str, ...] = field(
        default=(), metadata={"help": "Module leaf names the adapter targets (sorted, unique)."}
    )
    use_rslora: bool = field(default=False, metadata={"help": "Scale by alpha/sqrt(r)."})
    base_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model id or path the adapter belongs to."}
    )
    rank_pattern: Mapping[str, int] = field(
        default_factory=dict,
        metadata={"help": "Per-module rank overrides (PEFT semantics: first match in insertion order)."},
    )
    alpha_pattern: Mapping[str, float] = field(
        default_factory=dict,
        metadata={"help": "Per-module alpha overrides (PEFT semantics: first match in insertion order)."},
    )

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r <= 0:
            raise ConfigError(f"r must be a positive int, got {self.r!r}")
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, (int, float)) or not math.isfinite(self.lora_alpha):
            raise ConfigError(f"lora_alpha must be a finite number, got {self.lora_alpha!r}")
        if self.lora_alpha <= 0:
            raise ConfigError(f"lora_alpha must be > 0, got {self.lora_alpha!r}")
        if not isinstance(self.use_rslora, bool):  # "false" would scale by alpha/sqrt(r) in PEFT (truthy)
            raise ConfigError(f"use_rslora must be true or false, got {self.use_rslora!r} ({type(self.use_rslora).__name__}); fix adapter_config.json")
        if self.base_model_name_or_path is not None and not isinstance(self.base_model_name_or_path, str):
            raise ConfigError(f"base_model_name_or_path must be a string or null, got {self.base_model_name_or_path!r}")
        targets = self.target_modules
        if isinstance(targets, str):
            targets = (targets,)
        object.__setattr__(self, "target_modules", tuple(sorted(set(targets))))
        object.__setattr__(self, "rank_pattern", _frozen(self.rank_pattern))
        object.__setattr__(self, "alpha_pattern", _frozen(self.alpha_pattern))
        for key, rank in self.rank_pattern.items():
            _check_pattern("rank_pattern", key)
            if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
                raise ConfigError(f"rank_pattern[{key!r}] must be a positive int, got {rank!r}")
        for key, alpha in self.alpha_pattern.items():
            _check_pattern("alpha_pattern", key)
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or not alpha > 0:
                raise ConfigError(f"alpha_pattern[{key!r}] must be a finite number > 0, got {alpha!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        # The patterns are read-only MappingProxyType views, which stdlib pickle refuses: rebuild
        # through the constructor from plain dicts (torch.multiprocessing, process pools, Ray).
        return (
            type(self),
            (
                self.r,
                self.lora_alpha,
                self.target_modules,
                self.use_rslora,
                self.base_model_name_or_path,
                dict(self.rank_pattern),
                dict(self.alpha_pattern),
            ),
        )

    # -- per-module values, as PEFT computes them ------------------------------------------

    def rank_for(self, module: str) -> int:
        """Effective rank of ``module`` (``rank_pattern`` matched like PEFT)."""
        key = _pattern_key(self.rank_pattern, module)
        return int(self.rank_pattern[key]) if key is not None else self.r

    def alpha_for(self, module: str) -> float:
        """Effective alpha of ``module`` (``alpha_pattern`` matched like PEFT)."""
        key = _pattern_key(self.alpha_pattern, module)
        return float(self.alpha_pattern[key]) if key is not None else float(self.lora_alpha)

    def scale_for(self, module: str) -> float:
        """PEFT's ``scaling`` for ``module``: alpha_m / r_m, or alpha_m / sqrt(r_m) with rsLoRA."""
        rank = self.rank_for(module)
        denom = math.sqrt(rank) if self.use_rslora else rank
        return self.alpha_for(module) / denom

    @property
    def global_scale(self) -> float:
        """The single scale engines without pattern support apply to every module."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @property
    def is_uniform(self) -> bool:
        """True when every engine computes the same scale as PEFT (no patterns, no rsLoRA)."""
        return not self.rank_pattern and not self.alpha_pattern and not self.use_rslora

    def with_(self, **changes: Any) -> AdapterConfig:
        """A copy with ``changes`` applied (validated again)."""
        return replace(self, **changes)

    def pinned(self, modules: Iterable[str]) -> AdapterConfig:
        """A config giving each of ``modules`` the same rank and alpha whatever order its
        patterns are read in.

        PEFT matches ``rank_pattern``/``alpha_pattern`` first-match in key order, but writes
        ``adapter_config.json`` with sorted keys, so overlapping patterns (``"q_proj"`` and
        ``"model.layers.0.self_attn.q_proj"``) can change meaning on disk. When they would,
        the patterns are replaced by one entry per module whose value differs from the default;
        otherwise ``self`` is returned unchanged.

        Raises:
            ConfigError: even per-module patterns stay ambiguous (module paths that suffix-match
                each other); fold the scales with ``normalize_scaling`` instead.
        """
        modules = list(modules)
        if not self.rank_pattern and not self.alpha_pattern:
            return self
        if _same_values(self, _sorted_patterns(self), modules):
            return self
        pinned = self.with_(
            rank_pattern={m: self.rank_for(m) for m in modules if self.rank_for(m) != self.r},
            alpha_pattern={m: self.alpha_for(m) for m in modules if self.alpha_for(m) != float(self.lora_alpha)},
        )
        if not _same_values(self, _sorted_patterns(pinned), modules):
            raise ConfigError(
                "rank_pattern/alpha_pattern cannot be written order-independently for these module "
                "paths; apply lorasync.exporters.normalize_scaling() before saving"
            )
        return pinned

    # -- PEFT and JSON round trips ---------------------------------------------------------

    def to_peft(self) -> Any:
        """PEFT's ``LoraConfig`` for this adapter (what ``save_pretrained`` writes)."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.r,
            lora_alpha=self.lora_alpha,
            target_modules=list(self.target_modules),
            use_rslora=self.use_rslora,
            rank_pattern=dict(self.rank_pattern),
            alpha_pattern=dict(self.alpha_pattern),
            base_model_name_or_path=self.base_model_name_or_path,
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
            inference_mode=True,
        )

    @classmethod
    def from_peft(cls, config: Any) -> AdapterConfig:
        """Build from a PEFT ``LoraConfig`` (or its dict form).

        Raises:
            ConfigError: features no engine-bound adapter may carry (DoRA, bias, modules_to_save).
        """
        data = config if isinstance(config, Mapping) else config.to_dict()
        _refuse_foreign_math(data)
        if data.get("use_dora"):
            raise ConfigError("DoRA adapters are not supported by vLLM or SGLang; train plain LoRA")
        if data.get("bias", "none") != "none" or data.get("lora_bias"):
            raise ConfigError("LoRA bias is not supported by inference engines; set bias='none'")
        if data.get("modules_to_save"):
            raise ConfigError(
                "modules_to_save would send full module copies as adapter weights, which engines "
                "reject (runtime LoRA serves A/B pairs only); train without modules_to_save: put those "
                "modules in target_modules as LoRA, or keep them frozen"
            )
        targets = data.get("target_modules") or ()
        if isinstance(targets, str):
            # A string is a regex in PEFT, not a leaf name; derive the leaves from the tensors.
            targets = ()
        rank = data["r"]  # missing: KeyError, "not a PEFT LoRA config" to Adapter.load
        if not isinstance(rank, int) or isinstance(rank, bool):
            # PEFT keeps whatever JSON held; "8" or 8.0 would become a rank only by our cast.
            raise ConfigError(f"adapter_config.json r must be a JSON integer such as 8, got {rank!r}")
        return cls(
            r=rank,
            lora_alpha=data["lora_alpha"],
            target_modules=tuple(targets),
            use_rslora=False if data.get("use_rslora") is None else data["use_rslora"],  # a string: refused, never cast
            base_model_name_or_path=data.get("base_model_name_or_path"),
            rank_pattern=data.get("rank_pattern") or {},
            alpha_pattern=data.get("alpha_pattern") or {},
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "target_modules": list(self.target_modules),
            "use_rslora": self.use_rslora,
            "base_model_name_or_path": self.base_model_name_or_path,
            "rank_pattern": dict(self.rank_pattern),
            "alpha_pattern": dict(self.alpha_pattern),
        }


# init_lora_weights values whose saved adapter is plain LoRA over the untouched base model. PiSSA,
# OLoRA, CorDA and LoftQ rewrite the base weights at init: their factors only mean something over
# that rewritten base, which no engine has.
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")

# LoraConfig fields that change what the adapter computes and that neither lorasync nor the
# engines it feeds implement: their default values, anything else is refused.
_FOREIGN_MATH = {
    "layer_replication": None,
    "target_parameters": None,
    "alora_invocation_tokens": None,
    "trainable_token_indices": None,
    "use_qalora": False,
    "arrow_config": None,
}


def _refuse_foreign_math(data: Mapping[str, Any]) -> None:
    """Raise ConfigError for config fields that change the math and that lorasync does not
    carry to engines (serving the factors without them would serve another adapter)."""
    init = data.get("init_lora_weights", True)
    if not any(init is plain or (isinstance(plain, str) and init == plain) for plain in _PLAIN_INITS):
        shown = str(init)[:40]
        raise ConfigError(
            f"init_lora_weights={shown!r} rewrites the base model's weights when the adapter is created, so its "
            "factors are only correct over that rewritten base; save it converted to plain LoRA "
            "(PeftModel.save_pretrained(..., path_initial_model_for_weight_conversion=...)) and publish that"
        )
    for key, default in _FOREIGN_MATH.items():
        value = data.get(key, default)
        if value is not None and value != default and value not in ([], {}, ()):
            raise ConfigError(
                f"adapter_config.json sets {key}={str(value)[:60]!r}, which changes what the adapter computes and "
                "which lorasync and the inference engines do not implement; train and publish without it"
            )


def _check_pattern(field_name: str, key: object) -> None:
    r"""A rank/alpha pattern key must compile the way PEFT uses it (``(.*\.)?(<key>)$``)."""
    if not isinstance(key, str) or not key:
        raise ConfigError(f"{field_name} keys must be non-empty strings (module names or regexes), got {key!r}")
    try:
        re.compile(rf"(.*\.)?({key})$")
    except re.error as exc:
        raise ConfigError(
            f"{field_name} key {key[:80]!r} is not a valid regular expression ({exc}); PEFT matches these keys "
            "as regexes against module names: escape it or use the plain module name"
        ) from exc


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str | None:
    if not patterns:
        return None
    from peft.utils.other import get_pattern_key

    key = get_pattern_key(list(patterns), module)
    return key if key in patterns else None


def _sorted_patterns(config: AdapterConfig) -> AdapterConfig:
    """``config`` as PEFT reads it back from its own sorted-keys ``adapter_config.json``."""
    return config.with_(
        rank_pattern=dict(sorted(config.rank_pattern.items())),
        alpha_pattern=dict(sorted(config.alpha_pattern.items())),
    )


def _same_values(a: AdapterConfig, b: AdapterConfig, modules: Iterable[str]) -> bool:
    return all(a.rank_for(m) == b.rank_for(m) and a.alpha_for(m) == b.alpha_for(m) for m in modules)


def leaf_names(modules: Iterable[str]) -> tuple[str, ...]:
    """Sorted unique last segments of module paths (PEFT ``target_modules`` style)."""
    return tuple(sorted({m.rsplit(".", 1)[-1] for m in modules}))
