"""The slot write: an adapter lorasync staged goes into vLLM's stacked LoRA buffers in one pass.

vLLM activates an adapter (``LoRAModelManager.activate_adapter``) by calling ``set_lora`` on every
LoRA layer: per layer and slice, two fills of the slot and a copy per factor, a few thousand
small kernels and as many Python calls for a 36-layer model (14.6 ms for Qwen3-8B r16 on an
H200, measured). For adapters lorasync staged, the slot write keeps vLLM's own bookkeeping
(which slot, LRU eviction, the slot table the punica kernels read: vLLM's activate runs with an
empty module table) and writes the factors itself: one ``_foreach_zero_`` of the slot and one
``_foreach_copy_`` of the factors, exactly what ``set_lora`` copies for one tensor-parallel rank
(0.5-2.7 ms measured). It runs where vLLM's activation runs, in the engine core between steps,
so a slot in use by a running request is never written (vLLM evicts only inactive slots). Any
layer it does not know (MoE, embeddings with LoRA, sharded or tensor-parallel layers, another
device) sends the whole adapter down vLLM's own path.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["install_slot_write", "slot_writes"]

_WRITES = [0]  # slot writes done in this process (tests read it to know the path ran)


def slot_writes() -> int:
    """How many activations this process did with the slot write (vLLM's own path not counted)."""
    return _WRITES[0]

#: LoRA layer classes whose ``set_lora`` is "zero the slot, copy each slice's A and B" for one rank.
_SLOT_LAYERS = frozenset(
    {
        "ColumnParallelLinearWithLoRA",
        "MergedColumnParallelLinearWithLoRA",
        "QKVParallelLinearWithLoRA",
        "MergedQKVParallelLinearWithLoRA",
        "RowParallelLinearWithLoRA",
        "ReplicatedLinearWithLoRA",
    }
)


def install_slot_write(adapter_manager: Any) -> None:
    """Route activations of lorasync-staged adapters of ``adapter_manager`` (vLLM's
    ``LoRAModelManager``) through the slot write; a manager of another shape is left alone."""
    if adapter_manager is None or getattr(adapter_manager, "_lorasync_slot_write", False):
        return
    if not all(hasattr(adapter_manager, a) for a in ("modules", "lora_index_to_id", "_active_adapters", "_registered_adapters")):
        return  # a vLLM whose manager looks otherwise: its own activation only
    original = adapter_manager.activate_adapter

    def activate_adapter(lora_id: int) -> Any:
        registered = getattr(adapter_manager._registered_adapters, "cache", adapter_manager._registered_adapters)
        lora = registered.get(lora_id) if hasattr(registered, "get") else None
        if lora_id in adapter_manager._active_adapters or not getattr(lora, "_lorasync_staged", False):
            return original(lora_id)
        plan = _slot_plan(adapter_manager, lora)
        if plan is None:
            return original(lora_id)
        modules = adapter_manager.modules
        adapter_manager.modules = {}  # vLLM's bookkeeping alone: slot choice, eviction, slot table
        try:
            result = original(lora_id)
        finally:
            adapter_manager.modules = modules
        _write_slot(plan, adapter_manager.lora_index_to_id.index(lora_id))
        _WRITES[0] += 1
        return result

    adapter_manager.activate_adapter = activate_adapter
    adapter_manager._lorasync_slot_write = True


def _slot_plan(adapter_manager: Any, lora: Any) -> tuple[list[tuple[Any, list[Any], list[Any]]], list[Any]] | None:
    """``(writes, resets)``: per known layer its per-slice A and B (None: no factor), and the other
    layers, which the adapter leaves alone and whose slot vLLM would reset; None when some layer
    the adapter touches is one the slot write does not know."""
    writes, resets = [], []
    for name, module in adapter_manager.modules.items():
        weights = adapter_manager._get_lora_layer_weights(lora, name)
        known = type(module).__name__ in _SLOT_LAYERS and getattr(module, "tp_size", 1) == 1
        if not weights:
            if known:
                writes.append((module, [None] * module.n_slices, [None] * module.n_slices))
            else:
                resets.append(module)
            continue
        if not known:
            return None
        a = weights.lora_a if isinstance(weights.lora_a, list) else [weights.lora_a]
        b = weights.lora_b if isinstance(weights.lora_b, list) else [weights.lora_b]
        if len(a) != module.n_slices or len(b) != module.n_slices:
            return None
        device = module.lora_a_stacked[0].device
        if any(t is not None and t.device != device for t in (*a, *b)):
            return None
        writes.append((module, a, b))
    return writes, resets


def _write_slot(plan: tuple[list[tuple[Any, list[Any], list[Any]]], list[Any]], index: int) -> None:
    """What ``set_lora(index, ...)`` does for every layer, in one zero pass and one copy pass."""
    writes, resets = plan
    zero: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for module, a, b in writes:
        for s in range(module.n_slices):
            slot_a, slot_b, dst_a, dst_b = _views(module, s, index, a[s], b[s])
            zero += (slot_a, slot_b)
            if dst_a is not None:
                dst.append(dst_a)
                src.append(a[s])
            if dst_b is not None:
                dst.append(dst_b)
                src.append(b[s])
    if zero:
        torch._foreach_zero_(zero)
    if dst:
        torch._foreach_copy_(dst, src)
    for module in resets:
        module.reset_lora(index)


def _views(module: Any, s: int, index: int, a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[Any, ...]:
    """Slice ``s`` of slot ``index`` of ``module``'s stacked A and B, and the parts of them ``a``
    and ``b`` fill. Kept on the module per slot and shape: indexing 500 views costs milliseconds
    on every activation, and the stacked buffers live as long as the layer (their address is part
    of the key all the same)."""
    stacked_a, stacked_b = module.lora_a_stacked[s], module.lora_b_stacked[s]
    key = (s, index, None if a is None else tuple(a.shape), None if b is None else tuple(b.shape), stacked_a.data_ptr(), stacked_b.data_ptr())
    cache = module.__dict__.setdefault("_lorasync_slot_views", {})
    views = cache.get(key)
    if views is None:
        slot_a, slot_b = stacked_a[index], stacked_b[index]
        views = (
            slot_a,
            slot_b,
            None if a is None else slot_a[0, : a.shape[0], : a.shape[1]],
            None if b is None else slot_b[0, : b.shape[0], : b.shape[1]],
        )
        if len(cache) >= 64:  # slots x shapes of one layer: bounded, whatever vLLM does
            cache.clear()
        cache[key] = views
    return views
