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
        found = _program(adapter_manager, lora)
        if found is None:
            return original(lora_id)
        program, factors = found
        modules = adapter_manager.modules
        adapter_manager.modules = {}  # vLLM's bookkeeping alone: slot choice, eviction, slot table
        try:
            result = original(lora_id)
        finally:
            adapter_manager.modules = modules
        program.write(factors, adapter_manager.lora_index_to_id.index(lora_id))
        _WRITES[0] += 1
        return result

    adapter_manager.activate_adapter = activate_adapter
    adapter_manager._lorasync_slot_write = True


class _Program:
    """How one layout of adapter is written into a slot: per layer slice, which factor of which of
    the adapter's modules goes where, and the layers it leaves alone. Built once per layout
    (``_template``'s serial: every version of a run's adapter has one) and manager, from
    :func:`_slot_plan`; each activation then only gathers the new version's factors and runs
    the two passes of :func:`_write_slot`, instead of asking vLLM for every layer's weights and
    checking every layer again (2-3 ms of Python per activation for a 36-layer model)."""

    __slots__ = ("refs", "shapes", "resets", "pointers", "by_index", "size")

    def __init__(self, refs: list[tuple[Any, int, str, int | None, bool, bool]], shapes: list[Any], resets: list[Any], pointers: tuple[int, ...], size: int) -> None:
        self.refs, self.shapes, self.resets, self.pointers = refs, shapes, resets, pointers
        self.size = size  # how many modules the adapter it was learned on had: one more is another layout
        self.by_index: dict[int, tuple[list[torch.Tensor], list[tuple[list[int], list[torch.Tensor]]]]] = {}

    def factors(self, lora: Any) -> list[torch.Tensor] | None:
        """This version's factors in the program's order; None if they are not of its layout."""
        loras, out = lora.loras, []
        if len(loras) != self.size:
            return None  # a module more (or fewer) than the layout's: the program would miss it
        try:
            for _, _, name, s, has_a, has_b in self.refs:
                if not (has_a or has_b):
                    continue  # a layer this adapter leaves alone: its slot is only zeroed
                w = loras[name]
                if has_a:
                    out.append(w.lora_a if s is None else w.lora_a[s])
                if has_b:
                    out.append(w.lora_b if s is None else w.lora_b[s])
        except (KeyError, IndexError, TypeError, AttributeError):
            return None
        if [t.shape for t in out] != self.shapes:
            return None
        return out

    def write(self, factors: list[torch.Tensor], index: int) -> None:
        """What ``set_lora(index, ...)`` does for every layer: one zero pass over the slot, one
        copy pass of ``factors`` (:meth:`factors`, checked against this layout)."""
        targets = self.by_index.get(index)
        if targets is None:
            zero: list[torch.Tensor] = []
            dst: list[torch.Tensor] = []
            for module, s, _, _, has_a, has_b in self.refs:
                slot_a, slot_b = module.lora_a_stacked[s][index], module.lora_b_stacked[s][index]
                zero += (slot_a, slot_b)
            shapes = iter(self.shapes)
            for module, s, _, _, has_a, has_b in self.refs:
                slot_a, slot_b = module.lora_a_stacked[s][index], module.lora_b_stacked[s][index]
                if has_a:
                    shape = next(shapes)
                    dst.append(slot_a[0, : shape[0], : shape[1]])
                if has_b:
                    shape = next(shapes)
                    dst.append(slot_b[0, : shape[0], : shape[1]])
            # Contiguous targets (A, and B at the full rank) apart: one foreach call over tensors
            # that are all dense takes the fused kernels; a single strided one in the list sends
            # the whole list down the per-tensor path (a kernel launch per factor).
            dense = [i for i, t in enumerate(dst) if t.is_contiguous()]
            strided = [i for i, t in enumerate(dst) if not t.is_contiguous()]
            passes = [(part, [dst[i] for i in part]) for part in (dense, strided) if part]
            targets = self.by_index[index] = (zero, passes)
        zero, passes = targets
        if zero:
            torch._foreach_zero_(zero)
        for part, into in passes:
            torch._foreach_copy_(into, [factors[i] for i in part])
        for module in self.resets:
            module.reset_lora(index)


def _pointers(adapter_manager: Any) -> tuple[int, ...]:
    """Where every layer's stacked buffers are: a program is for these buffers only."""
    out: list[int] = []
    for module in adapter_manager.modules.values():
        for stacked in (getattr(module, "lora_a_stacked", None), getattr(module, "lora_b_stacked", None)):
            if isinstance(stacked, (list, tuple)):
                out.extend(t.data_ptr() for t in stacked if isinstance(t, torch.Tensor))
    return tuple(out)


def _program(adapter_manager: Any, lora: Any) -> tuple[_Program, list[torch.Tensor]] | None:
    """The slot-write program of ``lora``'s layout (made now if there is none yet) and the
    factors of ``lora``, checked against it; None where the slot write does not apply."""
    layout = getattr(lora, "_lorasync_layout", None)
    programs = adapter_manager.__dict__.setdefault("_lorasync_programs", {})
    program = programs.get(layout) if layout is not None else None
    if program is not None:
        if program.pointers != _pointers(adapter_manager):
            programs.clear()  # vLLM made new buffers: learn again
            program = None
        else:
            factors = program.factors(lora)
            if factors is not None:
                return program, factors
    plan = _slot_plan(adapter_manager, lora)
    if plan is None:
        return None
    writes, resets = plan
    refs: list[tuple[Any, int, str, int | None, bool, bool]] = []
    shapes: list[Any] = []
    names = {id(w): k for k, w in lora.loras.items()}
    for module, weights, a, b in writes:
        name = names.get(id(weights)) if weights is not None else None
        if weights is not None and name is None:
            return None  # weights vLLM found under no name of the adapter's: its own activation
        packed = isinstance(getattr(weights, "lora_a", None), list)
        for s in range(module.n_slices):
            refs.append((module, s, name or "", s if packed else None, a[s] is not None, b[s] is not None))
            shapes += [t.shape for t in (a[s], b[s]) if t is not None]
    program = _Program(refs, shapes, resets, _pointers(adapter_manager), len(lora.loras))
    factors = program.factors(lora)
    if factors is None:
        return None
    if layout is not None:
        if len(programs) >= 16:
            programs.clear()
        programs[layout] = program
    return program, factors


def _slot_plan(adapter_manager: Any, lora: Any) -> tuple[list[tuple[Any, Any, list[Any], list[Any]]], list[Any]] | None:
    """``(writes, resets)``: per known layer its weights and per-slice A and B (None: no factor),
    and the other layers, which the adapter leaves alone and whose slot vLLM would reset; None
    when some layer the adapter touches is one the slot write does not know."""
    writes, resets = [], []
    for name, module in adapter_manager.modules.items():
        weights = adapter_manager._get_lora_layer_weights(lora, name)
        known = type(module).__name__ in _SLOT_LAYERS and getattr(module, "tp_size", 1) == 1
        if not weights:
            if known:
                writes.append((module, None, [None] * module.n_slices, [None] * module.n_slices))
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
        writes.append((module, weights, a, b))
    return writes, resets
