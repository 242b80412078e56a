"""SGLang's adapter rules, in one place: what SGLang 0.5.23 refuses, or loads and serves wrongly.

Three callers read the same rules, so they cannot drift:

* :meth:`SGLangEngine.check_adapter` (the publisher calls it before any bytes move, for every
  LoRA transport: disk, ipc) and :meth:`SGLangEngine.preflight` raise the first violation;
* :meth:`SGLangEngine.load_adapter` checks a local directory's ``adapter_config.json`` for the
  one rule only the disk route has (per-module ranks, which tensor loads pad away);
* :func:`lorasync.inspection.inspect_adapter` turns violations of a directory (config and
  safetensors header only) into findings.

The rules, from SGLang's source (``sglang/srt/lora``):

* **scaling**: SGLang scales every module by ``lora_alpha / r`` and ignores ``use_rslora``,
  ``rank_pattern`` and ``alpha_pattern``; an adapter whose per-module PEFT scale differs
  loads "fine" and serves other numbers than training.
* **mixed ranks**: SGLang sizes every module at the config's ``r`` and fails at the first batch
  otherwise; tensor loads pad (exactly, :func:`lorasync.transforms.pad_ranks`), disk loads
  cannot.
* **packing**: SGLang packs q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; a layer
  adapting any of q/k/v needs ``q_proj`` and ``v_proj`` (else a bare ``KeyError`` or the module
  silently dropped), one adapting ``up_proj`` needs ``gate_proj``. Per-expert modules
  (``mlp.experts.{E}.gate_proj``) pack the same way, expert by expert.
* **MoE router**: ``mlp.gate`` is no LoRA target module of SGLang 0.5.23 (not in
  ``_KNOWN_LORA_TARGET_MODULES``; ``get_target_module_name`` finds no target for its weights, so
  the load fails): a router LoRA is refused.
* **MoE experts**: per-expert LoRA (``experts.{E}.…``, loaded into the ``gate_up_proj_moe`` /
  ``down_proj_moe`` buffers) is served, but ``LoRAManager.update_lora_info`` wires the experts
  only when the server's target modules include both ``gate_up_proj`` and ``down_proj``:
  otherwise expert LoRA would load and never apply. PEFT's fused 3-D keys are not read (a lorasync
  Adapter never holds them: ``Adapter.load`` converts them to per-expert keys).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lorasync.adapter._moe import group_experts, is_router
from lorasync.errors import IncompatibleAdapterError

if TYPE_CHECKING:
    from lorasync.adapter._adapter import Adapter
    from lorasync.adapter._config import AdapterConfig

__all__ = [
    "EXPERT_TARGETS",
    "MIXED_RANKS",
    "PACKING",
    "PACKS",
    "ROUTER",
    "SCALING",
    "Violation",
    "check",
    "check_saved_config",
    "safe_scaling",
    "served_leaves",
    "violations",
]

# SGLang's target-module normalization (sglang/srt/lora/utils.py get_normalized_target_modules):
# a served packed module covers all of its leaves.
PACKS: dict[str, frozenset[str]] = {
    "qkv_proj": frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj"}),
    "gate_up_proj": frozenset({"gate_proj", "up_proj", "gate_up_proj"}),
    "embed_tokens": frozenset({"embed_tokens", "vocab_emb", "embeddings", "word_embeddings"}),
    "lm_head": frozenset({"lm_head", "output", "unembed_tokens"}),
    "fused_qkv_a_proj_with_mqa": frozenset({"q_a_proj", "kv_a_proj_with_mqa", "fused_qkv_a_proj_with_mqa"}),
}
_PACK_OF = {leaf: pack for pack, leaves in PACKS.items() for leaf in leaves}

SCALING = "scaling"
MIXED_RANKS = "mixed_ranks"
PACKING = "packing"
ROUTER = "router"
EXPERT_TARGETS = "expert_targets"


@dataclass(frozen=True)
class Violation:
    """One rule an adapter breaks on SGLang.

    ``level`` is what SGLang itself does: ``"error"`` it refuses or fails, ``"warning"`` it
    loads the adapter and serves other numbers than training (lorasync refuses both).
    """

    rule: str  # SCALING | MIXED_RANKS | PACKING | ROUTER | EXPERT_TARGETS
    level: str
    message: str
    modules: tuple[str, ...] = ()


def served_leaves(target_modules: Any) -> frozenset[str] | None:
    """Leaf module names an SGLang server started with ``--lora-target-modules`` accepts.

    Args:
        target_modules: ``lora_target_modules`` as ``/server_info`` reports it.

    Returns:
        `frozenset[str] | None`: the leaves (a packed module counts for all of its leaves);
        ``None`` when it accepts anything (``all``, or no list reported).
    """
    if not target_modules:
        return None
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    if any(str(t) in ("all", "all-linear") for t in target_modules):
        return None
    leaves: set[str] = set()
    for module in target_modules:
        leaf = str(module).rsplit(".", 1)[-1]
        pack = _PACK_OF.get(leaf)
        leaves |= PACKS[pack] if pack else {leaf}
    return frozenset(leaves)


def safe_scaling(config: AdapterConfig, modules: list[str]) -> bool:
    """True when SGLang's one ``lora_alpha / r`` equals PEFT's scale on every module
    (what ``Adapter.engine_safe_scaling`` says for an adapter in memory)."""
    return not config.use_rslora and all(config.scale_for(m) == config.global_scale for m in modules)


def violations(
    ranks: Mapping[str, int], *, r: int, scaling_ok: bool, pads: bool, served: frozenset[str] | None = None
) -> list[Violation]:
    """Every SGLang rule an adapter of this shape breaks, in a fixed order.

    Args:
        ranks (`Mapping[str, int]`): module path -> its LoRA rank (from tensors or a header).
        r (`int`): the config's ``r``.
        scaling_ok (`bool`): PEFT's per-module scales all equal ``lora_alpha / r`` without rsLoRA.
        pads (`bool`): the route pads mixed ranks (tensor loads), so they break no rule.
        served (`frozenset[str]`, *optional*): the leaves the server was started for
            (:func:`served_leaves`); None when unknown or all.

    Returns:
        `list[Violation]`: empty when SGLang serves the adapter exactly as trained.
    """
    found: list[Violation] = []
    if not scaling_ok:
        found.append(
            Violation(
                SCALING,
                "warning",
                "SGLang scales every module by lora_alpha / r and ignores use_rslora, rank_pattern and "
                "alpha_pattern, so this adapter would be served with the wrong scale; convert it with "
                "lorasync.exporters.normalize_scaling(adapter) first",
            )
        )
    distinct = set(ranks.values())
    if not pads and distinct and distinct != {r}:
        found.append(
            Violation(
                MIXED_RANKS,
                "warning",
                f"adapter has per-module ranks {sorted(distinct)} but SGLang ignores rank_pattern and sizes "
                f"every module at r={r} (it fails at the first batch); write "
                "lorasync.engines.sglang.pad_ranks(adapter) instead, which is exact",
            )
        )
    routers = sorted(m for m in ranks if is_router(m))
    if routers:
        found.append(
            Violation(
                ROUTER,
                "error",
                f"SGLang 0.5.23 has no LoRA for the MoE router ({routers[0]}{' ...' if len(routers) > 1 else ''}): "
                "mlp.gate is not among its LoRA target modules and the load fails; train without router LoRA "
                "(drop mlp.gate.weight from target_parameters) or serve it with vLLM or the PEFT engine",
                tuple(routers),
            )
        )
    experts = group_experts(ranks)
    if experts and served is not None and not {"gate_proj", "up_proj", "down_proj"} <= served:
        found.append(
            Violation(
                EXPERT_TARGETS,
                "error",
                "SGLang applies MoE expert LoRA only when started with both gate_up_proj and down_proj in "
                f"--lora-target-modules (it serves {sorted(served)}); expert LoRA would load and never apply. "
                "Restart it with those target modules",
                tuple(sorted(m for members in experts.values() for m in members.values()))[:8],
            )
        )
    layers: dict[tuple[str, str], set[str]] = {}
    for module in ranks:
        prefix, _, leaf = module.rpartition(".")
        layers.setdefault((prefix, _PACK_OF.get(leaf, leaf)), set()).add(leaf)
    for (prefix, pack), leaves in sorted(layers.items()):
        need: set[str] = set()
        if pack == "qkv_proj" and leaves & {"q_proj", "k_proj", "v_proj"}:
            need = {"q_proj", "v_proj"}
        elif pack == "gate_up_proj" and "up_proj" in leaves:
            need = {"gate_proj"}
        missing = sorted(need - leaves)
        if missing:
            found.append(
                Violation(
                    PACKING,
                    "error",
                    f"{prefix}: SGLang packs {pack} and needs LoRA on {missing} wherever {sorted(leaves)} "
                    "is adapted (otherwise its load fails or the module is silently dropped); train those "
                    "modules too, or add them with zero lora_B",
                    tuple(missing),
                )
            )
    return found


def check(adapter: Adapter, *, url: str, pads: bool, served: frozenset[str] | None = None) -> None:
    """Raise the first rule ``adapter`` breaks on SGLang.

    Args:
        adapter (`Adapter`): the adapter to serve.
        url (`str`): the server, for the error.
        pads (`bool`): the route pads mixed ranks (tensor loads).
        served (`frozenset[str]`, *optional*): the leaves the server serves (``Capabilities.target_modules``).

    Raises:
        IncompatibleAdapterError: the message says how to convert the adapter.
    """
    ranks = {m: adapter.pair(m)[0].shape[0] for m in adapter.modules}
    found = violations(ranks, r=adapter.config.r, scaling_ok=adapter.engine_safe_scaling, pads=pads, served=served)
    if found:
        first = found[0]
        extra = {"modules": list(first.modules)} if first.modules else {}
        raise IncompatibleAdapterError(first.message, engine="sglang", url=url, **extra)


def check_saved_config(config: Mapping[str, Any], *, url: str, path: str) -> None:
    """The disk-route rules an ``adapter_config.json`` shows alone: scaling and per-module ranks.

    SGLang reads ``r`` and ``lora_alpha`` and scales every module by ``lora_alpha / r``: a saved
    rsLoRA adapter (PEFT scales it by ``lora_alpha / sqrt(r)``, ``sqrt(r)`` times stronger) or
    one whose ``alpha_pattern`` gives a module another scale would load and serve other numbers
    than training. A saved adapter whose modules differ in rank carries them in ``rank_pattern``
    (PEFT cannot build the shapes otherwise), so a ``rank_pattern`` value other than ``r`` means
    SGLang would fail at the first batch.

    Raises:
        IncompatibleAdapterError: the scale SGLang would apply differs, or mixed ranks; nothing was sent.
    """
    r = config.get("r")
    pattern = config.get("rank_pattern") or {}
    alphas = config.get("alpha_pattern") or {}
    if not isinstance(r, int) or not isinstance(pattern, Mapping) or not isinstance(alphas, Mapping):
        return  # SGLang's own loader reports malformed configs
    ranks = {str(m): int(v) for m, v in pattern.items() if isinstance(v, int)}
    if not _saved_scaling_ok(config, r, ranks, alphas):
        (scaling,) = [v for v in violations({}, r=r, scaling_ok=False, pads=True) if v.rule == SCALING]
        raise IncompatibleAdapterError(f"{path}: {scaling.message}", engine="sglang", url=url, path=path)
    if ranks and set(ranks.values()) != {r}:
        (mixed,) = [v for v in violations(ranks, r=r, scaling_ok=True, pads=False) if v.rule == MIXED_RANKS]
        raise IncompatibleAdapterError(f"{path}: {mixed.message}", engine="sglang", url=url, path=path)


def _saved_scaling_ok(config: Mapping[str, Any], r: int, ranks: Mapping[str, int], alphas: Mapping[str, Any]) -> bool:
    """PEFT's scale of every module a saved config names equals SGLang's ``lora_alpha / r``."""
    if config.get("use_rslora") and r != 1:  # alpha/sqrt(r) == alpha/r only at r = 1
        return False
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or r < 1:
        return True  # SGLang's own loader reports malformed configs
    sqrt = bool(config.get("use_rslora"))
    for module, value in alphas.items():
        rank = ranks.get(str(module), r)
        if isinstance(value, (int, float)) and rank >= 1 and value / (rank**0.5 if sqrt else rank) != alpha / r:
            return False
    return True
