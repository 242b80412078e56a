"""The worker's build of a staged adapter whose layout it built before, without vLLM's name parse.

vLLM turns an adapter's tensors into a ``LoRAModel`` (``LoRAModel.from_lora_tensors``) by parsing
every tensor name (the weights mapper's regexes, twice per tensor) and resolving every module's
rank and scale from the PEFT config: for Qwen3-8B (504 factors) several milliseconds of Python on
every publish, although a training run publishes the same names, shapes and config at every
step. Here the worker remembers, per LoRA manager, what vLLM's own build made of one layout (which
tensor became which module's ``lora_a`` or ``lora_b``, and each module's rank, alpha and scale)
and builds the next version of that layout from it: vLLM's ``LoRAModel.clone`` of the model it
built, and a shallow copy of each module's weights holding the new version's tensors.

It is taken only where it gives what vLLM's build would give, and otherwise vLLM builds:

* the layout is the same: the names, shapes and dtypes of the tensors, the adapter config, the
  device, the LoRA dtype, and whether the copies are page-locked (:func:`layout_key`);
* vLLM's build of that layout handed each tensor through unchanged (``tensor.to`` of a tensor
  already in place returns it): every tensor became exactly one factor of one module, and no
  attribute of a module or of the model other than those factors holds a tensor or anything
  vLLM would have computed from the values (:func:`remember` checks it on the first build);
* the first build of a layout, and any layout vLLM changed in flight, take vLLM's path.

Written here because vLLM has no cached or batched form of its build; everything the build sets
up beyond the factors (the manager's packing, validation, slots) still runs vLLM's way.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["build_from_template", "layout_key", "remember", "template_builds"]

_BUILDS = [0]  # builds done from a template in this process (tests read it to know the path ran)
_KEEP = 8  # layouts remembered per manager: a run publishes one; a fleet a few
_SERIALS = itertools.count(1)


def template_builds() -> int:
    """How many adapters this process built from a remembered layout."""
    return _BUILDS[0]


def layout_key(copies: Mapping[str, torch.Tensor], config: Mapping[str, Any], device: str, dtype: Any) -> tuple[Any, ...] | None:
    """What vLLM's build of ``copies`` depends on besides their values, or None where that cannot
    be told (a config that is not plain JSON)."""
    try:
        config_text = json.dumps(config, sort_keys=True)
    except (TypeError, ValueError):
        return None
    first = next(iter(copies.values()), None)
    pinned = first is not None and first.device.type == "cpu" and first.is_pinned()
    layout = tuple((k, t.dtype, t.device, tuple(t.shape), t.is_pinned() if pinned else False) for k, t in copies.items())
    return (layout, config_text, device, str(dtype))


class _Template:
    """What vLLM's build made of one layout: its model (for ``clone``) and, per module, a pristine
    copy of its weights with the tensor keys of its factors."""

    __slots__ = ("model", "modules", "serial")

    def __init__(self, model: Any, modules: list[tuple[str, Any, str, str]]) -> None:
        self.model, self.modules = model, modules
        self.serial = next(_SERIALS)  # the layout's name for the slot write's programs (_slots)


def _templates(adapter_manager: Any) -> OrderedDict[tuple[Any, ...], _Template]:
    return adapter_manager.__dict__.setdefault("_lorasync_templates", OrderedDict())


def remember(adapter_manager: Any, key: tuple[Any, ...] | None, lora: Any, copies: Mapping[str, torch.Tensor]) -> bool:
    """Remember vLLM's build ``lora`` of ``copies`` (call it before anything changes ``lora``: the
    scale fold, the manager's packing) as the template of ``key``, if it is one (module docstring).

    Returns:
        Whether it was remembered.
    """
    if key is None:
        return False
    by_id = {id(t): k for k, t in copies.items()}
    modules: list[tuple[str, Any, str, str]] = []
    used: set[str] = set()
    for name, weights in getattr(lora, "loras", {}).items():
        a_key, b_key = by_id.get(id(getattr(weights, "lora_a", None))), by_id.get(id(getattr(weights, "lora_b", None)))
        if a_key is None or b_key is None or a_key in used or b_key in used or a_key == b_key:
            return False  # a factor vLLM made otherwise (a cast, a pin, a split) or shared
        used.update((a_key, b_key))
        try:
            others = {k: v for k, v in vars(weights).items() if k not in ("lora_a", "lora_b")}
        except TypeError:
            return False  # weights without a __dict__: a vLLM this was not written against
        if any(_holds_tensor(v) for v in others.values()):
            return False  # something computed from the values (extra embeddings): not a template
        pristine = copy.copy(weights)
        pristine.lora_a = pristine.lora_b = None
        modules.append((name, pristine, a_key, b_key))
    if used != set(copies) or not modules:
        return False  # a tensor vLLM skipped or kept elsewhere (modules_to_save, base embeddings)
    if not callable(getattr(lora, "clone", None)) or any(_holds_tensor(v) for k, v in getattr(lora, "__dict__", {"": torch.empty(0)}).items() if k != "loras"):
        return False
    model = lora.clone(lora.id)
    model.loras = {}
    templates = _templates(adapter_manager)
    templates[key] = template = _Template(model, modules)
    lora._lorasync_layout = template.serial
    templates.move_to_end(key)
    while len(templates) > _KEEP:
        templates.popitem(last=False)
    return True


def build_from_template(adapter_manager: Any, key: tuple[Any, ...] | None, lora_model_id: int, copies: Mapping[str, torch.Tensor]) -> Any | None:
    """A new ``LoRAModel`` of ``copies``, as vLLM's build would make it, from the template of
    ``key``; None when there is none (vLLM builds, and :func:`remember` may learn it)."""
    template = _templates(adapter_manager).get(key) if key is not None else None
    if template is None:
        return None
    loras: dict[str, Any] = {}
    for name, pristine, a_key, b_key in template.modules:
        weights = copy.copy(pristine)
        weights.lora_a, weights.lora_b = copies[a_key], copies[b_key]
        loras[name] = weights
    model = template.model.clone(lora_model_id)
    model.loras = loras
    model._lorasync_layout = template.serial
    _BUILDS[0] += 1
    return model


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return False
