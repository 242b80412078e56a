"""The slot write's programs (engines/vllm/_slots.py): learned once per adapter layout, they write
what vLLM's ``set_lora`` writes for every layer, and are never used for what they were not
learned on (other buffers, other shapes, an adapter that is not of the layout)."""

from __future__ import annotations

import types

import torch

from lorasync.engines.vllm import _slots


class QKVParallelLinearWithLoRA:  # the name is what the slot write knows a layer by
    n_slices = 3
    tp_size = 1

    def __init__(self, slots: int, rank: int, fan_in: int, outs: tuple[int, ...]) -> None:
        self.lora_a_stacked = [torch.full((slots, 1, rank, fan_in), 7.0) for _ in outs]
        self.lora_b_stacked = [torch.full((slots, 1, o, rank), 7.0) for o in outs]

    def set_lora(self, index: int, a: list, b: list) -> None:  # vLLM's, for one rank
        for s in range(self.n_slices):
            self.lora_a_stacked[s][index] = 0
            self.lora_b_stacked[s][index] = 0
            if a[s] is not None:
                self.lora_a_stacked[s][index, 0, : a[s].shape[0], : a[s].shape[1]].copy_(a[s])
                self.lora_b_stacked[s][index, 0, : b[s].shape[0], : b[s].shape[1]].copy_(b[s])


class RowParallelLinearWithLoRA(QKVParallelLinearWithLoRA):
    n_slices = 1


def _manager(rank: int = 8) -> types.SimpleNamespace:
    modules = {
        f"layers.{i}.qkv_proj": QKVParallelLinearWithLoRA(4, rank, 16, (16, 8, 8)) for i in range(2)
    } | {f"layers.{i}.o_proj": RowParallelLinearWithLoRA(4, rank, 16, (16,)) for i in range(2)}
    return types.SimpleNamespace(modules=modules, _get_lora_layer_weights=lambda lora, name: lora.loras.get(name))


def _adapter(seed: int, rank: int, layout: int | None, *, skip: str = "") -> types.SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    loras = {}
    for i in range(2):
        qkv = types.SimpleNamespace(lora_a=[torch.randn(rank, 16, generator=g) for _ in range(3)], lora_b=[torch.randn(o, rank, generator=g) for o in (16, 8, 8)])
        loras[f"layers.{i}.qkv_proj"] = qkv
        if f"layers.{i}.o_proj" != skip:
            loras[f"layers.{i}.o_proj"] = types.SimpleNamespace(lora_a=torch.randn(rank, 16, generator=g), lora_b=torch.randn(16, rank, generator=g))
    return types.SimpleNamespace(loras=loras, _lorasync_layout=layout)


def _reference(manager: types.SimpleNamespace, lora: types.SimpleNamespace, index: int) -> dict[str, list[torch.Tensor]]:
    """The stacked buffers after vLLM's own activation of ``lora`` in slot ``index``."""
    out = {}
    for name, module in manager.modules.items():
        copy = type(module).__new__(type(module))
        copy.lora_a_stacked = [t.clone() for t in module.lora_a_stacked]
        copy.lora_b_stacked = [t.clone() for t in module.lora_b_stacked]
        w = lora.loras.get(name)
        a = (w.lora_a if isinstance(w.lora_a, list) else [w.lora_a]) if w else [None] * module.n_slices
        b = (w.lora_b if isinstance(w.lora_b, list) else [w.lora_b]) if w else [None] * module.n_slices
        copy.set_lora(index, a, b)
        out[name] = copy.lora_a_stacked + copy.lora_b_stacked
    return out


def _write(manager: types.SimpleNamespace, lora: types.SimpleNamespace, index: int) -> bool:
    found = _slots._program(manager, lora)
    if found is None:
        return False
    program, factors = found
    program.write(factors, index)
    return True


def _state(manager: types.SimpleNamespace) -> dict[str, list[torch.Tensor]]:
    return {name: m.lora_a_stacked + m.lora_b_stacked for name, m in manager.modules.items()}


def test_a_programmed_write_is_vllms_set_lora_for_every_version_and_slot() -> None:
    manager = _manager(rank=8)
    for step, index in enumerate((0, 1, 0, 3, 1)):  # versions of one layout, slots reused
        lora = _adapter(step, 8, layout=1)
        want = _reference(manager, lora, index)
        assert _write(manager, lora, index)
        for name, tensors in _state(manager).items():
            assert all(torch.equal(x, y) for x, y in zip(tensors, want[name])), (step, name)
    assert list(manager._lorasync_programs) == [1]  # one program for the layout


def test_a_lower_rank_writes_into_strided_slots_exactly() -> None:
    manager = _manager(rank=16)  # the slots hold rank 16; the adapter has 4: B's targets are strided
    lora = _adapter(3, 4, layout=2)
    want = _reference(manager, lora, 2)
    assert _write(manager, lora, 2)
    for name, tensors in _state(manager).items():
        assert all(torch.equal(x, y) for x, y in zip(tensors, want[name])), name


def test_a_program_is_not_used_for_what_it_was_not_learned_on() -> None:
    manager = _manager(rank=8)
    assert _write(manager, _adapter(0, 8, layout=5), 0)
    # Another adapter under the same layout name but another shape (a layer left out): checked,
    # learned again, written as vLLM writes it.
    odd = _adapter(1, 8, layout=5, skip="layers.1.o_proj")
    want = _reference(manager, odd, 0)
    assert _write(manager, odd, 0)
    assert all(all(torch.equal(x, y) for x, y in zip(t, want[n])) for n, t in _state(manager).items())
    # vLLM made new stacked buffers: the program's views are of the old ones; it learns again.
    for module in manager.modules.values():
        module.lora_a_stacked = [t.clone() for t in module.lora_a_stacked]
        module.lora_b_stacked = [t.clone() for t in module.lora_b_stacked]
    lora = _adapter(2, 8, layout=5)
    want = _reference(manager, lora, 1)
    assert _write(manager, lora, 1)
    assert all(all(torch.equal(x, y) for x, y in zip(t, want[n])) for n, t in _state(manager).items())


def test_an_adapter_with_a_module_more_than_the_layout_is_learned_again() -> None:
    # Outside attack (23:40 session): a program learned on an adapter leaving a layer alone wrote
    # that layer as zeros for an adapter of the same layout name that has it.
    manager = _manager(rank=8)
    assert _write(manager, _adapter(0, 8, layout=9, skip="layers.1.o_proj"), 0)
    full = _adapter(1, 8, layout=9)
    want = _reference(manager, full, 0)
    assert _write(manager, full, 0)
    assert all(all(torch.equal(x, y) for x, y in zip(t, want[n])) for n, t in _state(manager).items())
