"""PEFT adapter key names: the one place that builds and parses them.

``peft_key(module, "A")`` builds ``base_model.model.<module>.lora_A.weight`` (an embedding
module's ``peft_key(module, "A", embedding=True)`` is PEFT's ``...lora_embedding_A``, which has no
``.weight``: PEFT keeps those factors in a ``ParameterDict``); ``parse_peft_key`` is the inverse of
both. ``split_saved_key`` also reads the keys PEFT's own ``save_pretrained`` may leave
with the adapter-name segment (``...lora_A.default.weight``), for tools that inspect files. ``normalize_trainer_key`` strips trainer decorations (FSDP/compile/checkpoint
wrappers, DDP ``module.``, the adapter-name segment) so any exporter can map a decorated
parameter name onto the same canonical key.

Building, parsing and normalizing are cached (``functools.lru_cache``): every publish builds an
``Adapter`` whose few hundred keys are the same strings step after step, and matching them
against the regular expression again was a measurable share of a publish's CPU time (``lorasync
bench regression``); ``export`` of a 36-layer PEFT model normalized its 504 parameter names in
1.35 ms of its 6.2 ms. All three are pure functions of their arguments (an invalid name raises,
which is not cached).
"""

from __future__ import annotations

import functools
import re
from typing import Literal

from lorasync.errors import InvalidKeyError

__all__ = ["PEFT_PREFIX", "is_embedding_key", "normalize_trainer_key", "parse_peft_key", "peft_key", "split_peft_key", "split_saved_key"]

PEFT_PREFIX = "base_model.model."
Side = Literal["A", "B"]

# A module path is dotted identifiers or integers; nothing else may appear in a served key.
_SEGMENT = r"(?:[A-Za-z_][A-Za-z0-9_]*|[0-9]+)"
_MODULE = rf"{_SEGMENT}(?:\.{_SEGMENT})*"
_PEFT_KEY = re.compile(
    rf"^base_model\.model\.(?P<module>{_MODULE})\.(?:lora_(?P<side>[AB])\.weight|lora_embedding_(?P<emb>[AB]))$"
)
_SAVED_KEY = re.compile(
    rf"^base_model\.model\.(?P<module>{_MODULE})\.(?:lora_(?P<side>[AB])(?:\.(?P<adapter>[A-Za-z0-9_]+))?\.weight"
    rf"|lora_embedding_(?P<emb>[AB])(?:\.(?P<emb_adapter>[A-Za-z0-9_]+))?)$"
)
_FACTORS = {"lora_A": ("A", False), "lora_B": ("B", False), "lora_embedding_A": ("A", True), "lora_embedding_B": ("B", True)}

# Wrapper segments inserted by FSDP1, activation checkpointing and torch.compile.
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def peft_key(module: str, side: Side, *, embedding: bool = False) -> str:
    """The PEFT on-disk key for ``module``'s lora_A or lora_B factor (``embedding``: an
    ``nn.Embedding``'s ``lora_embedding_A`` ``[r, num_embeddings]`` / ``lora_embedding_B``
    ``[embedding_dim, r]``).

    Raises:
        InvalidKeyError: ``module`` is not a dotted path of identifiers and integers.
    """
    key = _built(module, side, embedding)
    if key is None:
        bad = f"{PEFT_PREFIX}{module}.lora_embedding_{side}" if embedding else f"{PEFT_PREFIX}{module}.lora_{side}.weight"
        raise InvalidKeyError(
            f"module path {module!r} cannot form a PEFT key; use dotted identifiers like "
            "'model.layers.0.self_attn.q_proj'",
            key=bad,
        )
    return key


@functools.lru_cache(maxsize=1 << 16)
def _built(module: str, side: str, embedding: bool) -> str | None:
    key = f"{PEFT_PREFIX}{module}.lora_embedding_{side}" if embedding else f"{PEFT_PREFIX}{module}.lora_{side}.weight"
    return key if _PEFT_KEY.match(key) else None


@functools.lru_cache(maxsize=1 << 16)
def _split(key: str) -> tuple[str, Side, bool] | None:
    match = _PEFT_KEY.match(key)
    if match is None:
        return None
    side: Side = "A" if (match["side"] or match["emb"]) == "A" else "B"
    return match["module"], side, match["emb"] is not None


def split_peft_key(key: str) -> tuple[str, Side, bool]:
    """Split a PEFT key into ``(module, "A" | "B", is an embedding factor)``.

    Raises:
        InvalidKeyError: ``key`` is neither ``base_model.model.<module>.lora_{A,B}.weight`` nor
            ``base_model.model.<module>.lora_embedding_{A,B}``.
    """
    parts = _split(key) if isinstance(key, str) else None
    if parts is None:
        raise InvalidKeyError(
            f"{key!r} is not a LoRA weight key; an adapter holds only "
            "'base_model.model.<module>.lora_A.weight' / '.lora_B.weight' tensors (and an embedding's "
            "'.lora_embedding_A' / '.lora_embedding_B'); base weights, full embedding weights and "
            "modules_to_save must not be sent to engines",
            key=key,
        )
    return parts


def parse_peft_key(key: str) -> tuple[str, Side]:
    """Split a PEFT key into ``(module, "A" | "B")`` (:func:`is_embedding_key` tells the two
    key forms apart).

    Raises:
        InvalidKeyError: ``key`` is neither ``base_model.model.<module>.lora_{A,B}.weight`` nor
            ``base_model.model.<module>.lora_embedding_{A,B}``.
    """
    module, side, _ = split_peft_key(key)
    return module, side


def is_embedding_key(key: str) -> bool:
    """Whether the PEFT key ``key`` is an embedding factor (``...lora_embedding_{A,B}``)."""
    parts = _split(key) if isinstance(key, str) else None
    return parts is not None and parts[2]


def split_saved_key(key: str) -> tuple[str, Side, str | None] | None:
    """Split a key read from a saved file into ``(module, side, adapter segment or None)``.

    ``base_model.model.m.lora_A.weight`` -> ``("m", "A", None)``;
    ``base_model.model.m.lora_A.default.weight`` -> ``("m", "A", "default")`` (engines refuse the
    segment, so callers report it); embedding factors (``...lora_embedding_A``) split the same
    way. Returns None for anything that is no LoRA weight.
    """
    match = _SAVED_KEY.match(key)
    if match is None:
        return None
    side: Side = "A" if (match["side"] or match["emb"]) == "A" else "B"
    return match["module"], side, match["adapter"] or match["emb_adapter"]


@functools.lru_cache(maxsize=1 << 16)
def normalize_trainer_key(name: str, adapter_name: str = "default") -> str | None:
    """Map a decorated trainer parameter name to its canonical PEFT key, or None if it is no
    LoRA factor of ``adapter_name``.

    Handles ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``, ``_orig_mod.``, leading
    ``module.`` (DDP), the PEFT ``base_model.model.`` prefix (added back if absent, as NeMo
    Automodel names lack it) and the adapter segment (``lora_A.<adapter_name>.weight``, and an
    embedding's ``lora_embedding_A.<adapter_name>``, a ``ParameterDict`` entry). Keys of other
    adapters, base weights, ``modules_to_save`` copies and full embedding weights return None.
    """
    parts = [p for p in name.split(".") if p not in WRAPPER_SEGMENTS]
    while parts and parts[0] == "module":
        parts = parts[1:]
    if len(parts) < 2:
        return None
    if parts[-1] == "weight" and len(parts) >= 3 and parts[-2] in ("lora_A", "lora_B"):
        factor, module_parts = parts[-2], parts[:-2]
    elif parts[-1] == "weight" and len(parts) >= 4 and parts[-3] in ("lora_A", "lora_B"):
        if parts[-2] != adapter_name:
            return None
        factor, module_parts = parts[-3], parts[:-3]
    elif parts[-1] in ("lora_embedding_A", "lora_embedding_B"):
        factor, module_parts = parts[-1], parts[:-1]
    elif len(parts) >= 3 and parts[-2] in ("lora_embedding_A", "lora_embedding_B"):
        if parts[-1] != adapter_name:
            return None
        factor, module_parts = parts[-2], parts[:-2]
    else:
        return None
    if "modules_to_save" in module_parts or "original_module" in module_parts:
        return None
    if module_parts[:2] == ["base_model", "model"]:
        module_parts = module_parts[2:]
    if not module_parts:
        return None
    side, embedding = _FACTORS[factor]
    # Built through peft_key, so only well-formed module paths survive (InvalidKeyError otherwise).
    return peft_key(".".join(module_parts), side, embedding=embedding)  # type: ignore[arg-type]
