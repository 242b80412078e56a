"""vLLM 0.32's rules for MoE LoRA, in one place, and the fused 3-D form its mixed format reads.

From vLLM's source (``vllm/lora``):

* **per-expert keys** (``...mlp.experts.{E}.{gate,up,down}_proj.lora_{A,B}.weight``, what every
  lorasync Adapter holds) load by default; ``LoRAModelManager`` packs them per layer with
  ``PackedLoRALayerWeights.pack_moe``, which asserts that **every expert of a layer has all three
  projections** and raises for **experts of one projection at different ranks**. lorasync
  refuses both before anything moves (:func:`violations`); missing projections can be added as
  zero LoRA, which is exact (``lorasync.transforms.complete_experts``);
* the **router** ``mlp.gate`` is a ``ReplicatedLinear`` that takes a LoRA slot, but 0.26 and 0.32
  never apply it: the MoE runner routes through its own reference to the bare gate. So
  :func:`check` refuses router LoRA where the release does not apply it (the release table
  ``_lora_compat.RELEASES``, ``router_lora``: every listed release; an unknown release too). The
  merged fallback serves it (the fold changes the gate's own weight);
* PEFT's **fused 3-D keys** (``mlp.experts.base_layer.lora_A.weight`` = gate_up_proj,
  ``mlp.experts.lora_A.weight`` = down_proj) load only when the engine runs with
  ``enable_mixed_moe_lora_format`` (``--enable-mixed-moe-lora-format``) and the request says
  ``is_3d_lora_weight=True``; ``_convert_3d_to_2d_moe_lora`` needs both parameters of a layer.
  lorasync sends them only when asked (``moe_lora_format="3d"``) and the engine advertises the
  format (``Capabilities.moe_3d``): :func:`check` refuses otherwise, and :func:`fused_tensors`
  builds them with the inverse of the export's layout (:func:`lorasync.adapter._moe.fuse`).
* vLLM's CPU build cannot run MoE LoRA (its MoE LoRA kernel is Triton-only): it loads the
  adapter, but serving tokens needs a GPU vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from lorasync.adapter._keys import peft_key
from lorasync.adapter._moe import LAYOUT, RULES, fuse, group_experts, is_router
from lorasync.engines.vllm._lora_compat import rules_for
from lorasync.errors import ConfigError, IncompatibleAdapterError

if TYPE_CHECKING:
    from lorasync.adapter._adapter import Adapter
    from lorasync.engines._engine import Capabilities

__all__ = ["FORMATS", "applies_router_lora", "check", "check_format", "fused_tensors", "num_experts_of", "refusals", "violations"]

FORMATS = ("per_expert", "3d")
_LEAVES = tuple(leaf for rule in LAYOUT for leaf in rule.leaves)


def check_format(value: object) -> str:
    """``moe_lora_format`` as given to a vLLM engine.

    Raises:
        ConfigError: neither ``"per_expert"`` nor ``"3d"``.
    """
    if value not in FORMATS:
        raise ConfigError(f"moe_lora_format must be one of {list(FORMATS)}, got {value!r}")
    return str(value)


def num_experts_of(hf_config: object) -> int | None:
    """The routed experts per layer a model config names (the keys vLLM reads), if any."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def violations(ranks: Mapping[str, int]) -> list[str]:
    """What vLLM 0.32 refuses in an adapter of these per-module ranks (module path -> rank).

    Returns:
        `list[str]`: one message per layer that breaks ``pack_moe``'s rules; empty when vLLM packs
        every layer's experts.
    """
    found = []
    layers: dict[str, dict[int, dict[str, int]]] = {}
    for module, rank in ranks.items():
        for path, members in group_experts([module]).items():
            ((expert, leaf),) = members
            layers.setdefault(path.rsplit(".", 1)[0], {}).setdefault(expert, {})[leaf] = rank
    for owner, experts in sorted(layers.items()):
        count = max(experts) + 1
        missing = sorted(f"{e}.{leaf}" for e in range(count) for leaf in _LEAVES if leaf not in experts.get(e, {}))
        if missing:
            found.append(
                f"{owner}: vLLM packs a layer's experts only when every expert has gate_proj, up_proj and down_proj "
                f"LoRA (pack_moe asserts it); missing {missing[:6]}{' ...' if len(missing) > 6 else ''}. Add them as "
                "zero LoRA with lorasync.transforms.complete_experts(adapter) (exact)"
            )
            continue
        for leaf in _LEAVES:
            distinct = sorted({experts[e][leaf] for e in experts})
            if len(distinct) > 1:
                found.append(
                    f"{owner}: vLLM refuses experts of one projection at different ranks ({leaf}: {distinct}); "
                    "pad them to one rank with zero rows and columns (lorasync.transforms.pad_ranks)"
                )
    return found


def applies_router_lora(version: str | None) -> bool:
    """Whether vLLM ``version`` (None: unknown) applies MoE router (``mlp.gate``) LoRA it loads."""
    return rules_for(version).router_lora


def refusals(ranks: Mapping[str, int], *, version: str | None) -> list[str]:
    """:func:`violations`, and router LoRA where vLLM ``version`` (None: unknown) loads it but
    does not apply it: it would report ok while serving the adapter without its router factors."""
    found = violations(ranks)
    routers = sorted(m for m in ranks if is_router(m))
    if routers and not applies_router_lora(version):
        found.append(
            f"vLLM {version or '(release unknown)'} loads MoE router LoRA ({routers[0]}{' ...' if len(routers) > 1 else ''}) "
            "but does not apply it: it would serve this adapter without its router factors. Train without router LoRA "
            "(leave mlp.gate out of target_modules / target_parameters), or publish with transport='merged' (folded "
            "into the gate's own weight)"
        )
    return found


def check(adapter: Adapter, caps: Capabilities, *, moe_lora_format: str) -> None:
    """Raise the first MoE rule ``adapter`` breaks on this vLLM.

    Raises:
        IncompatibleAdapterError: per-expert LoRA vLLM would not pack, router LoRA on a release
            that loads it but does not apply it (or an unknown release), or the fused 3-D format
            asked for an engine that does not advertise it (or an adapter it cannot express).
    """
    ranks = {m: adapter.pair(m)[0].shape[0] for m in adapter.modules}
    found = refusals(ranks, version=caps.version)
    if found:
        raise IncompatibleAdapterError(found[0], engine=caps.engine, url=caps.url)
    if moe_lora_format == "3d" and group_experts(adapter.modules):
        if not caps.moe_3d:
            raise IncompatibleAdapterError(
                f"moe_lora_format='3d' sends PEFT's fused 3-D expert LoRA, which {caps.engine} at {caps.url or '?'} does "
                "not load: it was started without --enable-mixed-moe-lora-format (enable_mixed_moe_lora_format=True). "
                "Restart it with that flag, or publish per-expert LoRA (moe_lora_format='per_expert', the default)",
                engine=caps.engine,
                url=caps.url,
            )
        fused_tensors(adapter, engine=caps.engine)  # refuses what 3-D cannot hold


def fused_tensors(adapter: Adapter, *, engine: str = "vllm", num_experts: int | None = None) -> dict[str, torch.Tensor]:
    """``adapter``'s tensors with every layer's experts in PEFT's fused 3-D keys (gate_up_proj under
    ``experts.base_layer``, down_proj under ``experts``), the layout vLLM's mixed format reads;
    other modules as they are.

    Raises:
        IncompatibleAdapterError: a layer without both fused parameters (vLLM converts only
            pairs), or experts whose rank or scale differs from the adapter's ``r`` and global
            scale (the 3-D keys carry one of each, ``lora_alpha / r``).
    """
    config = adapter.config
    groups = group_experts(adapter.modules)
    fused_keys = {adapter.key(m, side) for members in groups.values() for m in members.values() for side in ("A", "B")}
    out = {k: v for k, v in adapter.tensors.items() if k not in fused_keys}
    owners = {path.rsplit(".", 1)[0] for path in groups}
    for owner in sorted(owners):
        paths = {rule.param: f"{owner}.{rule.param}" for rule in LAYOUT}
        if any(p not in groups for p in paths.values()):
            raise IncompatibleAdapterError(
                f"{owner}: vLLM reads fused 3-D expert LoRA only as gate_up_proj and down_proj together; this adapter has "
                f"{sorted(p.rsplit('.', 1)[1] for p in paths.values() if p in groups)}. Publish per-expert LoRA "
                "(moe_lora_format='per_expert')",
                engine=engine,
            )
        experts = num_experts or 1 + max(e for p in paths.values() for (e, _) in groups[p])
        for param, path in paths.items():
            members = groups[path]
            odd = sorted(m for m in members.values() if config.rank_for(m) != config.r or config.scale_for(m) != config.global_scale)
            if odd:
                raise IncompatibleAdapterError(
                    f"{path}: fused 3-D LoRA carries the adapter's one rank and scale, but {odd[:3]} differ; publish "
                    "per-expert LoRA (moe_lora_format='per_expert')",
                    engine=engine,
                )
            a, b = fuse(RULES[param], {key: adapter.pair(m) for key, m in members.items()}, experts)
            if a.shape[0] != experts * config.r:
                raise IncompatibleAdapterError(
                    f"{path}: its experts' gate and up LoRA differ, which PEFT's 3-D layout can hold only at rank "
                    f"{a.shape[0] // experts}, not the adapter's r={config.r}; publish per-expert LoRA",
                    engine=engine,
                )
            saved_as = f"{owner}.base_layer" if param == "gate_up_proj" else owner
            out[peft_key(saved_as, "A")], out[peft_key(saved_as, "B")] = a, b
    return out
