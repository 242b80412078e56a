"""How the PEFT engine injects an Adapter into its base model: the ``LoraConfig`` and the state
dict PEFT loads, for dense modules and for MoE experts.

A dense module (``nn.Linear``, ``nn.Embedding``) is a ``target_modules`` entry and takes the
Adapter's factors as they are. transformers 5 has no per-expert modules: its experts are the
fused parameters ``mlp.experts.gate_up_proj`` / ``down_proj`` and its router a bare 2-D weight
(``mlp.gate.weight``), which PEFT adapts through ``target_parameters``. The Adapter's per-expert
factors are therefore fused back with :func:`lorasync.adapter._moe.fuse` (the inverse of what
``fsdp.export`` split), the router's taken as they are, and keyed under the ``ParamWrapper``
modules PEFT built for them, read back from the model after injection rather than guessed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lorasync.adapter._adapter import Adapter
from lorasync.adapter._keys import PEFT_PREFIX, peft_key
from lorasync.adapter._moe import LAYOUT, expert_module, fuse, parse_expert_module
from lorasync.errors import IncompatibleAdapterError

_RULES = {leaf: rule for rule in LAYOUT for leaf in rule.leaves}
_WRAPPERS = re.compile(r"(\.base_layer)+$")  # one per ParamWrapper around a parameter's module


@dataclass
class Injection:
    """The ``LoraConfig`` to inject and, per targeted parameter path, its ``(A, B)``."""

    config: Any
    fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    dense: list[str] = field(default_factory=list)

    def state_dict(self, adapter: Adapter, peft_model: Any, slot: str) -> dict[str, torch.Tensor]:
        """The state dict ``set_peft_model_state_dict`` loads into ``slot``: dense keys as the
        Adapter has them, fused factors under the wrapper PEFT made for each parameter."""
        out = {adapter.key(m, s): adapter.pair(m)[0 if s == "A" else 1] for m in self.dense for s in ("A", "B")}
        for name, module in peft_model.named_modules():
            if type(module).__name__ != "ParamWrapper" or slot not in module.lora_A:
                continue
            saved_as = name.removeprefix(PEFT_PREFIX)
            path = f"{_WRAPPERS.sub('', saved_as)}.{module.parameter_name}"
            if path in self.fused:
                out[peft_key(saved_as, "A")], out[peft_key(saved_as, "B")] = self.fused[path]
        return out


def plan(adapter: Adapter, base: Any, *, kind: str, name: str) -> Injection:
    """The injection of ``adapter`` (to be served as ``name``) into ``base`` (the transformers model).

    Raises:
        IncompatibleAdapterError: per-expert modules the base has no fused experts for, expert
            indices or shapes it does not have, or experts of one parameter at different scales
            (one fused parameter has one scale in PEFT).
    """
    config = adapter.config
    groups: dict[str, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}
    dense: list[str] = []
    params: dict[str, tuple[int, float]] = {}  # target parameter path -> (rank, alpha)
    fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in adapter.modules:
        parsed = parse_expert_module(module)
        if parsed is not None and _param(base, f"{parsed[0]}.{_RULES[parsed[2]].param}", dims=3) is not None:
            owner, expert, leaf = parsed
            groups.setdefault(f"{owner}.{_RULES[leaf].param}", {})[(expert, leaf)] = adapter.pair(module)
        elif _is_module(base, module):
            dense.append(module)
        elif _param(base, f"{module}.weight", dims=2) is not None:  # a router's bare weight
            fused[f"{module}.weight"] = adapter.pair(module)
            params[f"{module}.weight"] = (config.rank_for(module), config.alpha_for(module))
        else:
            raise IncompatibleAdapterError(
                f"the base model has no module or fused expert parameter for adapter module {module!r}; check that the "
                "adapter was trained on this base model",
                engine=kind,
                adapter=name,
                modules=[module],
            )
    for path, factors in groups.items():
        param = _param(base, path, dims=3)
        owner, _, name = path.rpartition(".")
        rule = next(r for r in LAYOUT if r.param == name)
        experts = param.shape[0]
        modules = [expert_module(owner, e, leaf) for e, leaf in factors]
        outside = sorted(m for (e, _), m in zip(factors, modules) if e >= experts)
        scales = {config.scale_for(m) for m in modules}
        if outside or len(scales) > 1:
            raise IncompatibleAdapterError(
                f"{path}: " + (f"the base model has {experts} experts, not {outside}" if outside else f"its experts have different scales {sorted(scales)}, which one fused PEFT parameter cannot hold; apply lorasync.exporters.normalize_scaling first"),
                engine=kind,
                adapter=name,
                modules=outside or modules,
            )
        a, b = fuse(rule, factors, experts)
        rank = a.shape[0] // experts
        fused[path] = (a, b)
        params[path] = (rank, _alpha_for(scales.pop(), rank, config.use_rslora, path, kind, name))
    peft_config = config.to_peft()
    peft_config.target_modules = set(dense) or None
    if fused:
        peft_config.target_parameters = sorted(fused)
        # One entry per parameter, first (PEFT matches patterns first-match): it names only that path.
        peft_config.rank_pattern = {**{re.escape(p): r for p, (r, _) in params.items()}, **peft_config.rank_pattern}
        peft_config.alpha_pattern = {**{re.escape(p): a for p, (_, a) in params.items()}, **peft_config.alpha_pattern}
    return Injection(peft_config, fused, dense)


def _alpha_for(scale: float, rank: int, rslora: bool, path: str, kind: str, name: str) -> float:
    """The alpha giving a rank-``rank`` fused parameter exactly ``scale``."""
    root: Callable[[float], float] = math.sqrt if rslora else float
    alpha = scale * root(rank)
    if alpha / root(rank) != scale:  # pragma: no cover - float rounding on an odd stacked rank
        raise IncompatibleAdapterError(
            f"{path}: no alpha gives its fused rank {rank} exactly the scale {scale}; apply "
            "lorasync.exporters.normalize_scaling first",
            engine=kind,
            adapter=name,
        )
    return alpha


def _param(base: Any, path: str, *, dims: int) -> torch.Tensor | None:
    module_path, _, name = path.rpartition(".")
    try:
        module = base.get_submodule(module_path)
    except AttributeError:
        return None
    while hasattr(module, "base_layer") and not isinstance(getattr(module, name, None), torch.nn.Parameter):
        module = module.base_layer
    param = getattr(module, name, None)
    return param if isinstance(param, torch.nn.Parameter) and param.dim() == dims else None


def _is_module(base: Any, path: str) -> bool:
    try:
        module = base.get_submodule(path)
    except AttributeError:
        return False
    base_layer = getattr(module, "get_base_layer", None)
    module = base_layer() if callable(base_layer) else module
    return isinstance(module, (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d)) or type(module).__name__ == "Conv1D"
