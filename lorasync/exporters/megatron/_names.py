"""Megatron-Bridge adapter names ↔ HF PEFT module paths: one rule table, both directions.

A Megatron-Bridge adapter parameter is named (after DDP/Float16Module ``module.`` prefixes)::

    decoder.layers.{i}.<path>.<container>[.adapter_<x>].linear_{in,out}.weight

``<container>`` is ``adapter`` (one LoRA) or ``adapters.{slot}`` (a MultiLoRA slot); the optional
``adapter_<x>`` segment is a CanonicalLoRA sub-adapter (``adapter_q`` ...). ``linear_in`` is LoRA A,
``linear_out`` is LoRA B. :data:`RULES` says, for each ``<path>``, which HF modules it becomes and
how its factors are sharded. Parsing (:func:`parse_name`) and the inverse (:func:`megatron_name`)
both read that one table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from lorasync.errors import ConfigError, InexactExportError, UnknownModuleError

__all__ = [
    "MOE_MODEL_TYPES",
    "RULES",
    "MegatronName",
    "MegatronRef",
    "ModuleRule",
    "hf_modules",
    "is_adapter_name",
    "megatron_name",
    "parse_name",
]

Side = Literal["A", "B"]
DORA_MAGNITUDE = "weight_magnitude"  # ParallelLinearDoRAAdapter's extra parameter
Parallel = Literal["column", "row", "replicated"]


@dataclass(frozen=True)
class ModuleRule:
    """How one Megatron module's adapter maps onto HF modules.

    ``megatron`` is the path under ``decoder.layers.{i}`` (``{e}`` = local expert index); ``hf``
    the path(s) under ``model.layers.{L}`` (``{E}`` = global expert index), in the order the
    fused ``linear_out`` rows hold them. ``parallel`` is the base linear's TP kind: column-parallel
    A is sharded on the rank axis, row-parallel A on its input axis, B always on its output axis.
    ``subs`` are the CanonicalLoRA sub-adapters aligned with ``hf``.
    """

    megatron: str
    hf: tuple[str, ...]
    parallel: Parallel
    fused: Literal["qkv", "fc1"] | None = None
    subs: tuple[str, ...] = ()
    experts: Literal["grouped", "sequential"] | None = None


_ATTN_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
_EXPERT_GATE_UP = ("mlp.experts.{E}.gate_proj", "mlp.experts.{E}.up_proj")

RULES: tuple[ModuleRule, ...] = (
    ModuleRule("self_attention.linear_qkv", _ATTN_QKV, "column", "qkv", ("adapter_q", "adapter_k", "adapter_v")),
    ModuleRule("self_attention.linear_proj", ("self_attn.o_proj",), "row"),
    ModuleRule("mlp.linear_fc1", _MLP_GATE_UP, "column", "fc1", ("adapter_gate", "adapter_up")),
    ModuleRule("mlp.linear_fc2", ("mlp.down_proj",), "row"),
    # Grouped GEMM (TEGroupedMLP): one adapter per layer, 2-D shared or 3-D [n_local, ...].
    ModuleRule("mlp.experts.linear_fc1", _EXPERT_GATE_UP, "column", "fc1", experts="grouped"),
    ModuleRule("mlp.experts.linear_fc2", ("mlp.experts.{E}.down_proj",), "row", experts="grouped"),
    # SequentialMLP: one adapter per local expert, numbered per EP rank; CanonicalLoRA splits its
    # fc1 into adapter_gate/adapter_up like a dense fc1 (it keeps only grouped fc1 fused).
    ModuleRule(
        "mlp.experts.local_experts.{e}.linear_fc1", _EXPERT_GATE_UP, "column", "fc1",
        ("adapter_gate", "adapter_up"), experts="sequential",
    ),
    ModuleRule("mlp.experts.local_experts.{e}.linear_fc2", ("mlp.experts.{E}.down_proj",), "row", experts="sequential"),
    # The router's weight is replicated, but Megatron-Bridge builds its adapter from two
    # column-parallel linears with gathered outputs (peft/utils.py: input_is_parallel=False for
    # TopKRouter): A is [r/TP, hidden] and B [E/TP, r] on each TP rank, so it gathers as column.
    ModuleRule("mlp.router", ("mlp.gate",), "column"),
)

# HF model types whose MoE blocks use the names above (``mlp.experts.{E}.gate_proj``, ``mlp.gate``).
# Others (Mixtral's ``block_sparse_moe.experts.{E}.w1`` ...) would get wrong names, so they are refused.
MOE_MODEL_TYPES = frozenset({"qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe"})

_NAME = re.compile(
    r"^decoder\.layers\.(?P<layer>\d+)\.(?P<path>.+?)"
    r"\.(?:adapter|adapters\.(?P<slot>\d+))(?:\.(?P<sub>adapter_[a-z]+))?"
    r"\.linear_(?P<io>in|out)\.weight$"
)


def _template_regex(template: str, field: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(re.escape("{" + field + "}"), rf"(?P<{field}>\d+)") + "$")


_RULE_REGEX = tuple((_template_regex(rule.megatron, "e"), rule) for rule in RULES)


@dataclass(frozen=True)
class MegatronName:
    """A parsed Megatron adapter parameter name (layer index as written, i.e. stage-local)."""

    layer: int
    rule: ModuleRule
    local_expert: int | None
    sub: str | None
    slot: int | None
    side: Side


def _strip(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def is_adapter_name(name: str) -> bool:
    """True for names that belong to a LoRA adapter (``.adapter.`` / ``.adapters.`` segments:
    factor weights and DoRA's ``weight_magnitude``), False for base weights (``.to_wrap.weight``),
    embeddings and TE ``_extra_state`` entries."""
    parts = _strip(name).split(".")
    return parts[-1] in ("weight", DORA_MAGNITUDE) and ("adapter" in parts or "adapters" in parts)


def _refuse_dora(name: str) -> None:
    raise InexactExportError(
        f"{name!r} is a DoRA magnitude (Megatron-Bridge DoRA): lorasync exports plain LoRA, and "
        "dropping the magnitudes would serve a different model (vLLM and SGLang do not serve DoRA "
        "either); train with LoRA or CanonicalLoRA, or merge the DoRA adapter into the base weights"
    )


def parse_name(name: str) -> MegatronName | None:
    """Parse a Megatron-Bridge adapter parameter name.

    Args:
        name (`str`): a state-dict key; leading ``module.`` prefixes are tolerated.

    Returns:
        `MegatronName` or `None`: None for names that are not adapter weights (base weights,
        ``_extra_state``), which exporters skip.

    Raises:
        UnknownModuleError: an adapter weight whose module no rule translates.
        InexactExportError: a DoRA magnitude (DoRA is refused, never exported as plain LoRA).
    """
    if not is_adapter_name(name):
        return None
    stripped = _strip(name)
    if stripped.endswith("." + DORA_MAGNITUDE):
        _refuse_dora(name)
    match = _NAME.match(stripped)
    if match is None:
        raise UnknownModuleError(
            f"{name!r} looks like an adapter weight but is not "
            "'decoder.layers.{i}.<module>.adapter[.adapter_<x>].linear_{in,out}.weight'; "
            "only decoder-layer LoRA adapters can be exported",
            key=name,
        )
    for regex, rule in _RULE_REGEX:
        found = regex.match(match["path"])
        if found is None:
            continue
        sub = match["sub"]
        if sub is not None and sub not in rule.subs:
            raise UnknownModuleError(
                f"{name!r}: sub-adapter {sub!r} is not one of {list(rule.subs) or 'none'} for "
                f"{rule.megatron}",
                key=name,
            )
        return MegatronName(
            layer=int(match["layer"]),
            rule=rule,
            local_expert=int(found["e"]) if rule.experts == "sequential" else None,
            sub=sub,
            slot=int(match["slot"]) if match["slot"] is not None else None,
            side="A" if match["io"] == "in" else "B",
        )
    known = ", ".join(rule.megatron for rule in RULES)
    raise UnknownModuleError(
        f"{name!r}: no rule translates module {match['path']!r} to an HF module (known: {known}); "
        "exclude it from the LoRA targets or extend lorasync.exporters.megatron._names.RULES",
        key=name,
    )


def hf_modules(rule: ModuleRule, layer: int, *, expert: int | None = None) -> tuple[str, ...]:
    """HF module paths of ``rule`` at global ``layer``, in fused-row order.

    ``expert`` fills ``{E}``; grouped rules left without one keep the ``{E}`` placeholder.
    """
    prefix = f"model.layers.{layer}."
    if expert is None:
        return tuple(prefix + t for t in rule.hf)
    return tuple(prefix + t.replace("{E}", str(expert)) for t in rule.hf)


# -- the inverse, derived from RULES ------------------------------------------------------------


@dataclass(frozen=True)
class MegatronRef:
    """Where an HF module's factor lives in Megatron (global layer numbering).

    ``name`` is the Megatron parameter name, ``piece`` the HF module's index among the rule's
    outputs (which slice of a fused ``linear_out``), ``ep_rank`` the EP rank holding a
    sequential expert, and ``expert`` the global expert (row of a packed tensor) or None.
    """

    name: str
    piece: int
    ep_rank: int = 0
    expert: int | None = None


_HF_REGEX = tuple(
    (re.compile(r"^model\.layers\.(?P<layer>\d+)\." + _template_regex(t, "E").pattern[1:]), rule, piece)
    for rule in RULES
    for piece, t in enumerate(rule.hf)
)


def megatron_name(
    hf_module: str,
    side: Side,
    *,
    lora_type: str = "lora",
    experts: Literal["grouped", "sequential"] = "grouped",
    num_local_experts: int | None = None,
    slot: int | None = None,
) -> MegatronRef:
    """The Megatron-Bridge parameter an HF module's factor comes from (inverse of the rules).

    Args:
        hf_module (`str`): e.g. ``model.layers.3.self_attn.k_proj`` (global layer).
        side (`"A"` or `"B"`): lora_A (``linear_in``) or lora_B (``linear_out``).
        lora_type (`str`): ``"lora"`` (fused) or ``"canonical_lora"`` (q/k/v, gate/up split).
        experts (`str`): which MoE layout expert modules come from.
        num_local_experts (`int`, *optional*): experts per EP rank; needed for sequential experts.
        slot (`int`, *optional*): MultiLoRA slot (``adapters.{slot}``) instead of ``adapter``.

    Returns:
        `MegatronRef`

    Raises:
        UnknownModuleError: no rule produces ``hf_module``.
        ConfigError: sequential experts without ``num_local_experts``.
    """
    container = "adapter" if slot is None else f"adapters.{slot}"
    io = "in" if side == "A" else "out"
    for regex, rule, piece in _HF_REGEX:
        match = regex.match(hf_module)
        if match is None or (rule.experts is not None and rule.experts != experts):
            continue
        layer = int(match["layer"])
        expert = int(match["E"]) if rule.experts else None
        path, ep_rank = rule.megatron, 0
        if rule.experts == "sequential":
            if not num_local_experts:
                raise ConfigError("sequential experts need num_local_experts to find the EP rank")
            ep_rank, local = divmod(expert or 0, num_local_experts)
            path = path.replace("{e}", str(local))
        sub = f".{rule.subs[piece]}" if lora_type == "canonical_lora" and rule.subs else ""
        name = f"decoder.layers.{layer}.{path}.{container}{sub}.linear_{io}.weight"
        return MegatronRef(name=name, piece=piece, ep_rank=ep_rank, expert=expert)
    raise UnknownModuleError(f"no Megatron rule produces HF module {hf_module!r}", key=hf_module)
