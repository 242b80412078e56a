"""MoE expert LoRA: PEFT ``target_parameters`` factors on transformers-5 fused experts ↔ one LoRA
pair per expert (the format vLLM, SGLang and Megatron-Bridge use). One layout, both directions.

transformers 5 keeps a layer's routed experts as 3-D parameters of ``<layer>.mlp.experts``:
``gate_up_proj`` ``[E, 2I, H]`` (expert e's gate rows, then its up rows: the forward takes
``chunk(2)``) and ``down_proj`` ``[E, H, I]``, for every family in :data:`MOE_MODEL_TYPES`.
PEFT's ``ParamWrapper`` gives each targeted parameter one factor pair for all experts,
``lora_A`` ``[E·r, in]`` and ``lora_B`` ``[out, r·E]``, and expert e's delta is
``B.view(out, r, E)[:, :, e] @ A.view(E, r, in)[e]`` times the parameter's scale (peft 0.21
``ParamWrapper.get_delta_weight``; vLLM 0.32's ``_convert_3d_to_2d_moe_lora`` reads the same
layout). So, for expert ``e`` and the leaves ``l`` of the parameter (:data:`LAYOUT`)::

    A[e, l] = A.view(E, r, in)[e]                      (the leaves of one expert share it)
    B[e, l] = B.view(out, r, E)[:, :, e][l·out/L : (l+1)·out/L]

:func:`split` applies that and :func:`fuse` is its inverse. The inverse is exact for any set of
per-expert factors: leaves whose A differ (CanonicalLoRA) are fused at the sum of their ranks with
a block-diagonal B, and smaller ranks are padded with zeros. A 2-D router weight
(``mlp.gate.weight``, used as ``F.linear(x, weight)``) is a plain LoRA module under its own name.

Where PEFT keeps those factors (its keys and configs) and the conversion of a whole adapter live
in :mod:`lorasync.adapter._moe_peft`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from lorasync.errors import ExpertLayoutError

__all__ = [
    "LAYOUT",
    "MOE_MODEL_TYPES",
    "RULES",
    "FusedRule",
    "expert_module",
    "fuse",
    "fused_rows",
    "group_experts",
    "is_router",
    "model_type_of_class",
    "parse_expert_module",
    "split",
]

#: HF ``model_type``s whose transformers-5 experts use :data:`LAYOUT` (the families the Megatron
#: exporter knows). GPT-OSS, for one, stores ``gate_up_proj`` transposed with gate and up
#: interleaved: refused, never guessed.
MOE_MODEL_TYPES = frozenset({"qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe"})
_CLASSES = {
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "OlmoeForCausalLM": "olmoe",
}


@dataclass(frozen=True)
class FusedRule:
    """One fused expert parameter: its name on the experts module and the per-expert modules
    its output rows hold, in row order."""

    param: str
    leaves: tuple[str, ...]


#: The fused expert parameters, in the experts module's definition order (PEFT's nesting order).
LAYOUT = (FusedRule("gate_up_proj", ("gate_proj", "up_proj")), FusedRule("down_proj", ("down_proj",)))
RULES = {rule.param: rule for rule in LAYOUT}
_LEAF_RULE = {leaf: rule for rule in LAYOUT for leaf in rule.leaves}
_EXPERT = re.compile(rf"^(?P<owner>.+\.experts)\.(?P<e>[0-9]+)\.(?P<leaf>{'|'.join(l for r in LAYOUT for l in r.leaves)})$")


def expert_module(owner: str, expert: int, leaf: str) -> str:
    """The per-expert module path: ``<owner>.<expert>.<leaf>`` (``...mlp.experts.3.gate_proj``)."""
    return f"{owner}.{expert}.{leaf}"


def parse_expert_module(module: str) -> tuple[str, int, str] | None:
    """``(owner, expert, leaf)`` of a per-expert module path, the inverse of :func:`expert_module`;
    None for any other module."""
    match = _EXPERT.match(module)
    return (match["owner"], int(match["e"]), match["leaf"]) if match else None


def fused_rows(module: str) -> tuple[str, int, int, int] | None:
    """Where a per-expert module's weight sits in its fused parameter: ``(fused parameter path,
    expert, leaf index, number of leaves)``; expert ``e``'s rows ``[i·out/L, (i+1)·out/L)`` of
    ``<path>[e]`` (the layout's rows). None for a module that is not per-expert."""
    parsed = parse_expert_module(module)
    if parsed is None:
        return None
    owner, expert, leaf = parsed
    rule = next(r for r in LAYOUT if leaf in r.leaves)
    return f"{owner}.{rule.param}", expert, rule.leaves.index(leaf), len(rule.leaves)


def group_experts(modules: Iterable[str]) -> dict[str, dict[tuple[int, str], str]]:
    """The per-expert modules among ``modules`` by the fused parameter they are rows of:
    ``{"<owner>.gate_up_proj": {(expert, leaf): module}}``."""
    groups: dict[str, dict[tuple[int, str], str]] = {}
    for module in modules:
        parsed = parse_expert_module(module)
        if parsed is not None:
            owner, expert, leaf = parsed
            groups.setdefault(f"{owner}.{_LEAF_RULE[leaf].param}", {})[(expert, leaf)] = module
    return groups


def is_router(module: str) -> bool:
    """Whether ``module`` is an MoE router (``...mlp.gate``, the name of every family in
    :data:`MOE_MODEL_TYPES`; a dense MLP's is ``gate_proj``)."""
    return module.endswith(".mlp.gate")


def model_type_of_class(name: str | None) -> str | None:
    """The ``model_type`` of a transformers class name PEFT records (``auto_mapping``), if known."""
    return _CLASSES.get(name or "")


# -- the layout: split and its inverse ---------------------------------------------------------


def split(rule: FusedRule, a: torch.Tensor, b: torch.Tensor, num_experts: int, *, path: str) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Expert ``e``'s factors of leaf ``l``, ``{(e, l): (A, B)}``, from the fused ``a`` ``[E·r, in]``
    and ``b`` ``[out, r·E]`` (module docstring). A is a view shared by the leaves of an expert;
    B is copied out (its expert's columns are strided).

    Raises:
        ExpertLayoutError: the shapes do not split into ``num_experts`` experts and the leaves.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] % num_experts or b.shape[1] != a.shape[0] or b.shape[0] % len(rule.leaves):
        raise ExpertLayoutError(
            f"{path}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not split into {num_experts} experts "
            f"x {list(rule.leaves)} (PEFT's layout is A [experts*r, in], B [out, r*experts]); export the model "
            "itself, or fix the adapter's r / rank_pattern",
            parameter=path,
        )
    rank = a.shape[0] // num_experts
    a3, b3 = a.reshape(num_experts, rank, a.shape[1]), b.reshape(b.shape[0], rank, num_experts)
    rows = b.shape[0] // len(rule.leaves)
    out = {}
    for e in range(num_experts):
        for i, leaf in enumerate(rule.leaves):
            out[(e, leaf)] = (a3[e], b3[i * rows : (i + 1) * rows, :, e].contiguous())
    return out


def fuse(rule: FusedRule, factors: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused ``(a, b)`` that computes exactly ``factors`` (``{(e, l): (A, B)}``), the inverse of
    :func:`split`.

    Experts whose leaves share one A (what :func:`split` gives, and Megatron's fused fc1) keep
    rank ``r``: ``split(fuse(f))`` is ``f`` bit for bit. Leaves with different A are stacked on the
    rank axis with a block-diagonal B; experts with a smaller rank, leaves or experts without
    factors are zero-padded. Both leave every ``B·A`` unchanged. All factors share one scale (the
    caller checks).
    """
    blocks: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # per expert: A_e, B_e per leaf
    sample = next(iter(factors.values()))
    dtype = sample[0].dtype
    in_features = sample[0].shape[1]
    rows = {leaf: next((b.shape[0] for (_, l), (_, b) in factors.items() if l == leaf), 0) for leaf in rule.leaves}
    if 0 in rows.values():  # a leaf no expert has: its rows are the other leaves' (gate and up are equal halves)
        known = max(rows.values())
        rows = {leaf: known for leaf in rule.leaves}
    for e in range(num_experts):
        present = [factors.get((e, leaf)) for leaf in rule.leaves]
        pairs = [p for p in present if p is not None]
        if not pairs:
            blocks.append((torch.zeros(0, in_features, dtype=dtype), [torch.zeros(rows[leaf], 0, dtype=dtype) for leaf in rule.leaves]))
            continue
        first = pairs[0][0]
        if all(p is None or p[0] is first or torch.equal(p[0], first) for p in present):
            blocks.append((first, [p[1] if p is not None else torch.zeros(rows[l], first.shape[0], dtype=dtype) for p, l in zip(present, rule.leaves)]))
            continue
        stacked = torch.cat([p[0] for p in pairs], dim=0)
        bs, offset = [], 0
        for p, leaf in zip(present, rule.leaves):
            b = torch.zeros(rows[leaf], stacked.shape[0], dtype=dtype)
            if p is not None:
                b[:, offset : offset + p[0].shape[0]] = p[1]
                offset += p[0].shape[0]
            bs.append(b)
        blocks.append((stacked, bs))
    rank = max(a.shape[0] for a, _ in blocks)
    out_features = sum(rows.values())
    a = torch.zeros(num_experts, rank, in_features, dtype=dtype)
    b = torch.zeros(out_features, rank, num_experts, dtype=dtype)
    for e, (a_e, bs) in enumerate(blocks):
        a[e, : a_e.shape[0]] = a_e
        b[:, : a_e.shape[0], e] = torch.cat(bs, dim=0)
    return a.reshape(num_experts * rank, in_features), b.reshape(out_features, rank * num_experts)
