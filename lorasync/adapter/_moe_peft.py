"""Where PEFT keeps ``target_parameters`` factors of fused MoE experts, and the conversion of a
whole adapter into one LoRA per expert (the layout itself is :mod:`lorasync.adapter._moe`).

Keys: a parameter's factors are saved under its module with one ``.base_layer`` per wrapper
around it. PEFT nests one ``ParamWrapper`` per targeted parameter of a module, the first one in
the module's definition order innermost, so ``experts.base_layer.lora_A.weight`` is
``gate_up_proj`` when ``down_proj`` is targeted too and ``experts.lora_A.weight`` is the last
targeted parameter (:func:`targets_in_keys`; :func:`targets_in_model` reads the wrappers of a live
model instead). Per-parameter ranks and alphas (PEFT matches its patterns against the parameter
path, ``model.layers.0.mlp.experts.gate_up_proj``) become patterns naming the per-expert modules.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lorasync.adapter._config import AdapterConfig
from lorasync.adapter._keys import parse_peft_key, peft_key
from lorasync.adapter._moe import LAYOUT, MOE_MODEL_TYPES, RULES, expert_module, model_type_of_class, split
from lorasync.errors import ExpertLayoutError

__all__ = [
    "Target",
    "convert",
    "model_type_of_saved",
    "refuse_fused",
    "split_peft_config",
    "targets_in_keys",
    "targets_in_model",
    "unfuse",
]

_ROUTER_PARAM = "weight"  # a router's 2-D weight, targeted as "<...>.mlp.gate.weight"


@dataclass(frozen=True)
class Target:
    """One PEFT-targeted parameter and where its factors are saved.

    ``owner`` is the module holding the parameter (``model.layers.0.mlp.experts``), ``saved_as``
    the module path its factors are keyed under (``owner`` plus one ``.base_layer`` per wrapper
    around it), ``num_experts`` 1 for a 2-D parameter; ``rank`` and ``alpha`` are PEFT's for it.
    """

    owner: str
    param: str
    saved_as: str
    num_experts: int
    rank: int
    alpha: float

    @property
    def path(self) -> str:
        """The parameter's path, as ``target_parameters`` names it."""
        return f"{self.owner}.{self.param}"


def model_type_of_saved(peft_config: Any) -> str | None:
    """The base ``model_type`` a saved PEFT config records: its ``auto_mapping`` base class (PEFT
    writes it for adapters without a ``task_type``). Never read from ``base_model_name_or_path``:
    a name in a file is not a path to open."""
    mapping = getattr(peft_config, "auto_mapping", None) if not isinstance(peft_config, Mapping) else peft_config.get("auto_mapping")
    return model_type_of_class(mapping.get("base_model_class")) if isinstance(mapping, Mapping) else None


def refuse_fused(module: str, key: str) -> None:
    """Refuse a module path that only fused factors have: PEFT's wrapper segment ``.base_layer``
    or a bare ``.experts`` module, which no engine serves as a LoRA module.

    Raises:
        ExpertLayoutError: naming the key.
    """
    if module.endswith(".base_layer") or module.endswith(".experts"):
        raise ExpertLayoutError(
            f"{key} holds PEFT target_parameters factors of fused experts (A [experts*r, in]), which no engine serves "
            "under that name; read them with Adapter.load (the saved adapter_config.json names target_parameters) or "
            "lorasync.exporters.fsdp.export(model), which convert them into one LoRA per expert",
            parameter=module,
            key=key,
        )


# -- where the fused factors are ---------------------------------------------------------------


def targets_in_model(model: Any, adapter_name: str, clean: Callable[[str], str | None]) -> list[Target]:
    """The parameters ``adapter_name`` targets through PEFT ``ParamWrapper`` modules of ``model``.

    Args:
        model: the (possibly wrapped) PEFT model, or its ``named_modules()`` already listed.
        adapter_name: the PEFT adapter.
        clean: maps a decorated module name to its PEFT module path (no prefix, no wrappers),
            or None for a name outside the adapter.
    """
    found = []
    for name, module in model if isinstance(model, list) else model.named_modules():
        if type(module).__name__ != "ParamWrapper" or adapter_name not in getattr(module, "lora_A", {}):
            continue
        saved_as = clean(name)
        if saved_as is None:
            continue
        owner = _owner(saved_as)
        path = f"{owner}.{module.parameter_name}"
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else None
        if getattr(base, "is_transposed", False):
            raise ExpertLayoutError(
                f"{path} is stored transposed (is_transposed): lorasync converts only the [experts, out, in] layout of "
                f"{sorted(MOE_MODEL_TYPES)}; train LoRA on that model's attention/dense layers, or export per-expert LoRA",
                parameter=path,
            )
        found.append(Target(owner, module.parameter_name, saved_as, int(module.num_experts), int(module.r[adapter_name]), float(module.lora_alpha[adapter_name])))
    return found


def targets_in_keys(
    shapes: Mapping[str, Sequence[int]],
    target_parameters: Iterable[str],
    rank_of: Callable[[str], int],
    alpha_of: Callable[[str], float],
) -> list[Target]:
    """The targeted parameters of saved factors (``shapes``: PEFT key -> shape), from the config's
    ``target_parameters`` and PEFT's nesting rule (module docstring).

    Args:
        shapes: every key of the adapter and its tensor's shape.
        target_parameters: the config's ``target_parameters``.
        rank_of / alpha_of: PEFT's rank and alpha for a parameter path (rank/alpha patterns).

    Raises:
        ExpertLayoutError: keys nested deeper than the targeted parameters, a parameter no rule
            covers, or shapes that contradict the layout.
    """
    wanted = [str(t) for t in target_parameters]
    by_owner: dict[str, dict[int, str]] = {}  # owner -> depth -> saved_as
    for key in shapes:
        module = parse_peft_key(key)[0]
        owner = _owner(module)
        depth = (len(module) - len(owner)) // len(".base_layer")
        candidates = _params_of(owner)
        if not any(_targeted(f"{owner}.{p}", wanted) for p in candidates):
            if depth:
                raise ExpertLayoutError(
                    f"{key} is saved under a .base_layer wrapper but target_parameters {wanted} names no parameter "
                    f"of {owner} that lorasync converts ({[f'{owner}.{p}' for p in candidates] or 'none'}); export "
                    "the model itself",
                    parameter=owner,
                )
            continue  # a plain LoRA module
        by_owner.setdefault(owner, {})[depth] = module
    found = []
    for owner, saved in sorted(by_owner.items()):
        params = [p for p in _params_of(owner) if _targeted(f"{owner}.{p}", wanted)]
        if sorted(saved) != list(range(len(params))):
            raise ExpertLayoutError(
                f"{owner}: factors saved at wrapper depths {sorted(saved)} do not match the {len(params)} targeted "
                f"parameters {params} (PEFT wraps each of them); save the adapter with PEFT's save_pretrained",
                parameter=owner,
            )
        # Innermost (deepest) is the first targeted parameter in definition order.
        for depth, module in saved.items():
            param = params[len(saved) - 1 - depth]
            path = f"{owner}.{param}"
            rank = rank_of(path)
            rows = shapes[peft_key(module, "A")][0]
            experts = 1 if param == _ROUTER_PARAM else rows // rank if rank and rows % rank == 0 else 0
            if experts < 1:
                raise ExpertLayoutError(
                    f"{path}: lora_A has {rows} rows, not a multiple of its rank {rank}; set r / rank_pattern to "
                    "the rank the adapter was trained with",
                    parameter=path,
                )
            found.append(Target(owner, param, module, experts, rank, alpha_of(path)))
    _check_pairs(found, shapes)
    return found


def unfuse(tensors: Mapping[str, torch.Tensor], targets: Sequence[Target], *, model_type: str | None) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, float]]]:
    """``tensors`` with every target's fused factors replaced by one pair per expert (a router by
    its own module's pair), and each new module's ``(rank, alpha)``.

    Raises:
        ExpertLayoutError: a 3-D target of a model family outside :data:`MOE_MODEL_TYPES` (or of
            an unknown one), a parameter no engine serves as LoRA, shapes that do not split.
    """
    out = dict(tensors)
    values: dict[str, tuple[int, float]] = {}
    for target in targets:
        a, b = out.pop(peft_key(target.saved_as, "A")), out.pop(peft_key(target.saved_as, "B"))
        rule = RULES.get(target.param) if target.owner.endswith(".experts") else None
        if target.param == _ROUTER_PARAM and target.num_experts == 1 and target.owner.endswith(".gate"):
            # The router's weight [E, H] in F.linear(x, weight): exactly a linear layer's LoRA.
            out[peft_key(target.owner, "A")], out[peft_key(target.owner, "B")] = a, b
            values[target.owner] = (target.rank, target.alpha)
            continue
        if rule is None or target.num_experts < 2:
            raise ExpertLayoutError(
                f"{target.path} is a PEFT target parameter lorasync cannot serve as LoRA: it converts the fused experts "
                f"{[f'mlp.experts.{r.param}' for r in LAYOUT]} and the router weight mlp.gate.weight; target the "
                "module with target_modules instead, or leave it out",
                parameter=target.path,
            )
        if model_type not in MOE_MODEL_TYPES:
            raise ExpertLayoutError(
                f"{target.path}: the expert layout of model type {model_type!r} is not known to lorasync (it converts "
                f"{sorted(MOE_MODEL_TYPES)}; GPT-OSS, for one, interleaves gate and up). "
                + ("Pass model_type= with the base model's config.json model_type" if model_type is None else "Export per-expert LoRA instead"),
                parameter=target.path,
            )
        for (e, leaf), pair in split(rule, a, b, target.num_experts, path=target.path).items():
            module = expert_module(target.owner, e, leaf)
            out[peft_key(module, "A")], out[peft_key(module, "B")] = pair
            values[module] = (target.rank, target.alpha)
    return out, values


# -- a whole adapter ----------------------------------------------------------------------------


def split_peft_config(data: Mapping[str, Any]) -> tuple[AdapterConfig, list[str]]:
    """``(config without target_parameters, target_parameters)`` of a PEFT LoRA config dict: every
    other field is validated as :meth:`AdapterConfig.from_peft` does.

    Raises:
        ConfigError: what ``from_peft`` refuses.
    """
    targets = data.get("target_parameters") or []
    if isinstance(targets, str):
        targets = [targets]
    return AdapterConfig.from_peft({**data, "target_parameters": None}), [str(t) for t in targets]


def convert(
    tensors: Mapping[str, torch.Tensor],
    config: AdapterConfig,
    *,
    target_parameters: Sequence[str],
    model_type: str | None,
    targets: Sequence[Target] | None = None,
) -> tuple[dict[str, torch.Tensor], AdapterConfig]:
    """An adapter with ``target_parameters`` factors as per-expert LoRA: the tensors and a config
    under which every module keeps PEFT's rank and alpha.

    Args:
        tensors: PEFT keys to factors, fused ones among them.
        config: the adapter's config without ``target_parameters`` (:func:`split_peft_config`).
        target_parameters: what PEFT targeted.
        model_type: the base model's ``model_type`` (decides the expert layout).
        targets: the targeted parameters when the model itself was read (:func:`targets_in_model`);
            found from the keys and ``target_parameters`` otherwise.

    Returns:
        ``(tensors, config)``; ``config.target_modules`` is empty (the Adapter derives it).

    Raises:
        ExpertLayoutError: what cannot be converted exactly, naming the parameter.
    """
    if targets is None:
        shapes = {k: tuple(t.shape) for k, t in tensors.items()}
        targets = targets_in_keys(shapes, target_parameters, config.rank_for, config.alpha_for)
    unfilled = sorted(t for t in target_parameters if not any(_targeted(target.path, [t]) for target in targets))
    if unfilled:
        # PEFT would target parameters the factors do not cover (random or none at all, by
        # model): the files have no single meaning.
        raise ExpertLayoutError(
            f"target_parameters {unfilled} has no factors in the adapter (no parameter of it was saved); save the "
            "adapter with PEFT's save_pretrained from the model it was trained on, or drop those entries",
            parameter=unfilled[0],
        )
    out, values = unfuse(tensors, targets, model_type=model_type)
    base = config.with_(target_modules=())
    if all(base.rank_for(m) == r and base.alpha_for(m) == a for m, (r, a) in values.items()):
        return out, base
    # Put one pattern per target first (PEFT matches first-match): it names only that target's
    # new modules, so every other module keeps what the config gave it.
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    for target in targets:
        key = re.escape(target.owner) + (r"\.[0-9]+\.(?:" + "|".join(RULES[target.param].leaves) + ")" if target.param in RULES else "")
        ranks[key], alphas[key] = target.rank, target.alpha
    fixed = base.with_(rank_pattern={**ranks, **base.rank_pattern}, alpha_pattern={**alphas, **base.alpha_pattern})
    modules = {parse_peft_key(k)[0] for k in out}
    want = {m: values.get(m, (config.rank_for(m), config.alpha_for(m))) for m in modules}
    if any((fixed.rank_for(m), fixed.alpha_for(m)) != v for m, v in want.items()):  # pragma: no cover - defensive
        fixed = base.with_(
            rank_pattern={m: r for m, (r, _) in want.items() if r != base.r},
            alpha_pattern={m: a for m, (_, a) in want.items() if a != float(base.lora_alpha)},
        )
    return out, fixed


# -- helpers -------------------------------------------------------------------------------------


def _owner(module: str) -> str:
    while module.endswith(".base_layer"):
        module = module[: -len(".base_layer")]
    return module


def _params_of(owner: str) -> list[str]:
    """The parameters lorasync converts on a module of this name, in definition order."""
    if owner.endswith(".experts"):
        return [rule.param for rule in LAYOUT]
    if owner.endswith(".gate"):
        return [_ROUTER_PARAM]
    return []


def _targeted(path: str, wanted: Sequence[str]) -> bool:
    # PEFT's own match for target_parameters: the full path or a dotted suffix of it.
    return any(path == t or path.endswith(f".{t}") for t in wanted)


def _check_pairs(targets: Sequence[Target], shapes: Mapping[str, Sequence[int]]) -> None:
    """Both fused parameters of one experts module: gate_up's output is twice down's input and
    down's output is gate_up's input (the layout's own geometry), else the nesting was misread."""
    by_owner = {(t.owner, t.param): t for t in targets}
    for (owner, param), gate_up in by_owner.items():
        down = by_owner.get((owner, "down_proj"))
        if param != "gate_up_proj" or down is None:
            continue
        gu_a, gu_b = shapes[peft_key(gate_up.saved_as, "A")], shapes[peft_key(gate_up.saved_as, "B")]
        dn_a, dn_b = shapes[peft_key(down.saved_as, "A")], shapes[peft_key(down.saved_as, "B")]
        if gu_b[0] != 2 * dn_a[1] or dn_b[0] != gu_a[1]:
            raise ExpertLayoutError(
                f"{owner}: the factors under {gate_up.saved_as} (A {list(gu_a)}, B {list(gu_b)}) and {down.saved_as} "
                f"(A {list(dn_a)}, B {list(dn_b)}) are not gate_up_proj [2I, H] and down_proj [H, I]; save the "
                "adapter with PEFT's save_pretrained",
                parameter=f"{owner}.gate_up_proj",
            )
