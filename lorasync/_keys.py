"""PEFT adapter key names: the one place that builds and parses them.

``peft_key(module, "A")`` builds ``base_model.model.<module>.lora_A.weight``; ``parse_peft_key``
is its inverse. ``split_saved_key`` also reads the keys PEFT's own ``save_pretrained`` may leave
with the adapter-name segment (``...lora_A.default.weight``), for tools that inspect files. ``normalize_trainer_key`` strips trainer decorations (FSDP/compile/checkpoint
wrappers, DDP ``module.``, the adapter-name segment) so any exporter can map a decorated
parameter name onto the same canonical key.
"""

from __future__ import annotations

import re
from typing import Literal

from lorasync.errors import InvalidKeyError

__all__ = ["PEFT_PREFIX", "normalize_trainer_key", "parse_peft_key", "peft_key", "split_saved_key"]

PEFT_PREFIX = "base_model.model."
Side = Literal["A", "B"]

# A module path is dotted identifiers or integers; nothing else may appear in a served key.
_SEGMENT = r"(?:[A-Za-z_][A-Za-z0-9_]*|[0-9]+)"
_MODULE = rf"{_SEGMENT}(?:\.{_SEGMENT})*"
_PEFT_KEY = re.compile(rf"^base_model\.model\.(?P<module>{_MODULE})\.lora_(?P<side>[AB])\.weight$")
_SAVED_KEY = re.compile(
    rf"^base_model\.model\.(?P<module>{_MODULE})\.lora_(?P<side>[AB])(?:\.(?P<adapter>[A-Za-z0-9_]+))?\.weight$"
)

# Wrapper segments inserted by FSDP1, activation checkpointing and torch.compile.
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def peft_key(module: str, side: Side) -> str:
    """The PEFT on-disk key for ``module``'s lora_A or lora_B weight."""
    key = f"{PEFT_PREFIX}{module}.lora_{side}.weight"
    if not _PEFT_KEY.match(key):
        raise InvalidKeyError(
            f"module path {module!r} cannot form a PEFT key; use dotted identifiers like "
            "'model.layers.0.self_attn.q_proj'",
            key=key,
        )
    return key


def parse_peft_key(key: str) -> tuple[str, Side]:
    """Split a PEFT key into ``(module, "A" | "B")``.

    Raises:
        InvalidKeyError: ``key`` is not ``base_model.model.<module>.lora_{A,B}.weight``.
    """
    match = _PEFT_KEY.match(key)
    if match is None:
        raise InvalidKeyError(
            f"{key!r} is not a LoRA weight key; an adapter holds only "
            "'base_model.model.<module>.lora_A.weight' / '.lora_B.weight' tensors "
            "(base weights, embeddings and modules_to_save must not be sent to engines)",
            key=key,
        )
    side: Side = "A" if match["side"] == "A" else "B"
    return match["module"], side


def split_saved_key(key: str) -> tuple[str, Side, str | None] | None:
    """Split a key read from a saved file into ``(module, side, adapter segment or None)``.

    ``base_model.model.m.lora_A.weight`` -> ``("m", "A", None)``;
    ``base_model.model.m.lora_A.default.weight`` -> ``("m", "A", "default")`` (engines refuse the
    segment, so callers report it). Returns None for anything that is no LoRA weight.
    """
    match = _SAVED_KEY.match(key)
    if match is None:
        return None
    side: Side = "A" if match["side"] == "A" else "B"
    return match["module"], side, match["adapter"]


def normalize_trainer_key(name: str, adapter_name: str = "default") -> tuple[str, Side] | None:
    """Map a decorated trainer parameter name to ``(module, side)``, or None if it is no
    LoRA weight of ``adapter_name``.

    Handles ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``, ``_orig_mod.``, leading
    ``module.`` (DDP), the PEFT ``base_model.model.`` prefix (added back if absent, as NeMo
    Automodel names lack it) and the adapter segment ``lora_A.<adapter_name>.weight``. Keys of
    other adapters, base weights, ``modules_to_save`` copies and embeddings return None.
    """
    parts = [p for p in name.split(".") if p not in _WRAPPER_SEGMENTS]
    while parts and parts[0] == "module":
        parts = parts[1:]
    if len(parts) < 3 or parts[-1] != "weight":
        return None
    if parts[-2] in ("lora_A", "lora_B"):
        side_seg, module_parts = parts[-2], parts[:-2]
    elif len(parts) >= 4 and parts[-3] in ("lora_A", "lora_B"):
        if parts[-2] != adapter_name:
            return None
        side_seg, module_parts = parts[-3], parts[:-3]
    else:
        return None
    if "modules_to_save" in module_parts or "original_module" in module_parts:
        return None
    if module_parts[:2] == ["base_model", "model"]:
        module_parts = module_parts[2:]
    if not module_parts:
        return None
    module = ".".join(module_parts)
    side: Side = "A" if side_seg == "lora_A" else "B"
    # Round-trip through the canonical key so only well-formed module paths survive.
    return parse_peft_key(peft_key(module, side))
