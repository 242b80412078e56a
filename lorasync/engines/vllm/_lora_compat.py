"""What differs between the vLLM releases lorasync runs against: how vLLM's own
``WorkerLoRAManager._load_adapter`` builds an adapter (so the worker extension's staged-tensor
loader, ``worker._load_staged``, mirrors the release it runs in), and how the release serves
adapters where lorasync's clients depend on it (``LoRARequest`` equality, ``load_inplace``,
unload). docs/engines/vllm.md has the table.

Read from the releases' sources: 0.26.0 (the newest release pinning torch 2.11, run on the H200,
docs/benchmarks-gpu.md), 0.32.0 (the CPU build the suite runs), and the 0.33.0 and 0.34.0 wheels
(GPU only, read, not run). A release between them gets the rules of the newest listed release
not newer than it, a newer one those of the newest listed, an unknown one the oldest's (the
cautious answer to every question below); a hook the installed release lacks is skipped (it was
added later), never called blindly.

This module imports nothing from vLLM: the worker passes in what it found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lorasync.engines._versions import parse_version

__all__ = ["LoaderRules", "rules_for"]


@dataclass(frozen=True)
class LoaderRules:
    """How one vLLM release's LoRA loader treats a checkpoint.

    Attributes:
        mapper (`str`): the ``WeightsMapper`` method whose result renames checkpoint keys
            (0.26: ``get_unstacked_mapper``, which drops the QKV/MLP fusion maps; 0.32:
            ``get_rename_mapper``, renames only).
        validators (`tuple[str, ...]`): ``LoRAModelManager`` checks run on the built model
            (0.32 validates the MoE layout and classification heads; 0.26 has none).
        patterns (`bool`): whether ``PEFTHelper`` honours ``rank_pattern`` / ``alpha_pattern``
            (0.26 drops them: every module gets the global ``lora_alpha / r``).
        base_layer_names (`bool`): base weights of a LoRA-wrapped layer load only under
            ``<module>.base_layer.weight`` (0.26: ``load_weights`` with LoRA on refuses
            ``<module>.weight``, so a merged update must be renamed; 0.32 maps it itself).
        router_lora (`bool`): whether the MoE router's (``mlp.gate``) LoRA is applied. Both
            releases load it into a slot, and neither applies it: the MoE runner computes the
            routing through its own reference to the bare gate. 0.26 serves the adapter as if it
            had no router LoRA (measured on the H200: log-probs identical with and without it).
            0.32's ``LoRAModelManager`` tries to rewire that reference (``wrapped_by_id``), but
            sets it on the runner's LoRA wrapper, whose forward calls the runner, which still
            holds the bare gate (read from the real engine's module graph by
            ``tests/engines/peer_vllm_moe.py``, which fails once a release applies it).
        request_identity_has_id (`bool`): ``LoRARequest.__eq__``/``__hash__`` take ``lora_int_id``
            besides the name (0.34; before, the name alone). vLLM collects a batch's requests in a
            ``set``, so before 0.34 two LoRA ids under one name (a name loaded again while
            requests of its unloaded version still run) are one adapter to it: one of them is
            not activated, and its requests run on a slot that is not theirs or kill the
            EngineCore. lorasync refuses such a load on those releases.
        inplace_persists (`bool`): the server caches a ``load_inplace=True`` request with the flag
            still set, so the worker re-reads the adapter from disk on every step (0.32 and
            before; 0.33 resets the flag before caching). lorasync warns when asked for it there.
        unload_frees (`bool`): unloading frees the adapter's slot and cache (no release through
            0.34.0: the API server only forgets the name, vLLM #54839 open).
    """

    mapper: str
    validators: tuple[str, ...]
    patterns: bool
    base_layer_names: bool = False
    router_lora: bool = False
    request_identity_has_id: bool = False
    inplace_persists: bool = True
    unload_frees: bool = False


RELEASES: dict[tuple[int, ...], LoaderRules] = {
    (0, 26, 0): LoaderRules(mapper="get_unstacked_mapper", validators=(), patterns=False, base_layer_names=True),
    (0, 32, 0): LoaderRules(
        mapper="get_rename_mapper",
        validators=("_validate_moe_lora_format", "_validate_modules_to_save", "_validate_token_classification_lora"),
        patterns=True,
    ),
    # 0.33: the two classification checks became one; serving.py resets load_inplace before caching.
    (0, 33, 0): LoaderRules(
        mapper="get_rename_mapper",
        validators=("_validate_moe_lora_format", "_validate_classification_head_lora"),
        patterns=True,
        inplace_persists=False,
    ),
    # 0.34: LoRARequest compares (and hashes) name and lora_int_id.
    (0, 34, 0): LoaderRules(
        mapper="get_rename_mapper",
        validators=("_validate_moe_lora_format", "_validate_classification_head_lora"),
        patterns=True,
        inplace_persists=False,
        request_identity_has_id=True,
    ),
}


def rules_for(version: object) -> LoaderRules:
    """The rules of the newest listed release not newer than ``version`` (the oldest listed for
    older or unparsable versions, ``None`` included: the cautious answers)."""
    parsed = parse_version(version)
    known = sorted(RELEASES)
    chosen = known[0]
    for release in known:
        if parsed is not None and parsed >= release:
            chosen = release
    return RELEASES[chosen]


def rename_mapper(rules: LoaderRules, model: Any) -> Any:
    """The model's checkpoint-key mapper as this release's loader derives it, or None."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return None
    method = getattr(mapper, rules.mapper, None)
    if method is None:  # a release between the listed ones that has the other method only
        method = getattr(mapper, "get_rename_mapper", None) or getattr(mapper, "get_unstacked_mapper", None)
    return method() if method is not None else mapper


def validate(rules: LoaderRules, adapter_manager: Any, lora: Any) -> None:
    """Run this release's checks on a built ``LoRAModel`` (those the release has)."""
    for name in rules.validators:
        check = getattr(adapter_manager, name, None)
        if check is not None:
            check(lora)


def to_base_layer_names(tensors: dict[str, Any], model: Any) -> dict[str, Any]:
    """HF checkpoint names of LoRA-wrapped layers' weights, renamed ``<module>.base_layer.<p>``
    so the model's own ``load_weights`` (which still stacks q/k/v and gate/up) finds them."""
    wrapped = {n[: -len(".base_layer.weight")] for n, _ in model.named_parameters() if n.endswith(".base_layer.weight")}
    if not wrapped:
        return tensors
    packed = {part: whole for whole, parts in getattr(model, "packed_modules_mapping", {}).items() for part in parts}
    out = {}
    for name, tensor in tensors.items():
        module, _, param = name.rpartition(".")
        prefix, _, leaf = module.rpartition(".")
        target = f"{prefix}.{packed.get(leaf, leaf)}"
        if any(w == target or w.endswith("." + target) or target.endswith("." + w) for w in wrapped):
            name = f"{module}.base_layer.{param}"
        out[name] = tensor
    return out
