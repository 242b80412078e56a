"""The worker's batched build (engines/vllm/_build.py) gives exactly what vLLM's per-tensor build
gives: the same casts, the same scaled lora_B, bit for bit, and copies that share nothing with
the staged snapshot vLLM rebuilds evicted adapters from."""

from __future__ import annotations

import pytest
import torch

from lorasync.engines.vllm._build import fold_scaling, owned_copy, parsed_names
from lorasync.wire.cuda_ipc import _header_plan
from lorasync.wire.d2h import gather_into
from lorasync.wire.layout import plan
from lorasync.wire.shm import read_segment, write_segment
from lorasync.wire.views import BufferViews, apply_views


def _staged(dtype: torch.dtype, *, cut: bool = False) -> dict[str, torch.Tensor]:
    """An adapter as a worker stages it: each tensor copied out of shared memory, A and B
    interleaved; ``cut``: views of one buffer, as a CUDA IPC stage cuts them (a BufferViews)."""
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for layer in range(3):
        for module, (out_f, in_f) in {"q_proj": (48, 32), "k_proj": (16, 32), "down_proj": (32, 80)}.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(8, in_f, generator=g).to(dtype)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, 8, generator=g).to(dtype)
    if cut:
        layout = plan(tensors, {})
        flat = torch.empty(layout.nbytes, dtype=torch.uint8)
        gather_into(flat, layout, list(tensors.values()), chunk_bytes=layout.nbytes)
        return apply_views(flat, _header_plan(layout.header)[0])
    segment = write_segment(tensors, {})
    try:
        staged, _ = read_segment(segment.name, segment.nbytes)
    finally:
        segment.release()
    return staged


@pytest.mark.parametrize("cut", [False, True], ids=["copied", "one-buffer"])
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16, torch.float16, None])
def test_owned_copy_is_the_per_tensor_cast_and_owns_its_memory(source: torch.dtype, target: torch.dtype | None, cut: bool) -> None:
    staged = _staged(source, cut=cut)
    before = {k: t.clone() for k, t in staged.items()}
    copies = owned_copy(staged, target)
    assert list(copies) == list(staged)
    for key, t in staged.items():
        want = t.to(dtype=target or t.dtype, copy=True)
        assert copies[key].dtype == want.dtype and copies[key].shape == want.shape
        assert torch.equal(copies[key], want)
        assert copies[key].untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    # What vLLM does to a build (scale lora_B in place) never reaches the staged snapshot.
    for t in copies.values():
        t.mul_(3)
    assert all(torch.equal(staged[k], before[k]) for k in staged)


def test_one_buffer_is_copied_whole_until_the_dict_changes() -> None:
    """A CUDA IPC stage's tensors (views of one buffer, in the LoRA dtype) are copied as that one
    buffer; once anything in the dict changed, they are copied one by one, never from the stale
    buffer."""
    staged = _staged(torch.bfloat16, cut=True)
    assert isinstance(staged, BufferViews) and staged.flat is not None
    whole = owned_copy(staged, torch.bfloat16)
    flats = {t.untyped_storage().data_ptr() for t in whole.values()}
    assert len(flats) == 1 and flats != {staged.flat.untyped_storage().data_ptr()}  # one new buffer
    key = next(iter(staged))
    replaced = torch.full_like(staged[key], 5)
    staged[key] = replaced  # no longer a view of the buffer
    assert staged.flat is None
    copies = owned_copy(staged, torch.bfloat16)
    assert torch.equal(copies[key], replaced) and list(copies) == list(staged)
    for name in ("pop", "popitem", "clear", "update", "setdefault", "__delitem__", "__ior__"):
        fresh = _staged(torch.bfloat16, cut=True)
        first = next(iter(fresh))
        args = {"pop": (first,), "popitem": (), "clear": (), "update": ({first: replaced},), "setdefault": ("new", replaced), "__delitem__": (first,), "__ior__": ({first: replaced},)}[name]
        getattr(fresh, name)(*args)
        assert fresh.flat is None, name
        assert all(torch.equal(owned_copy(fresh, None)[k], t) for k, t in fresh.items()), name


def test_the_name_memo_answers_what_vllms_parse_answers() -> None:
    """parsed_names memoises vLLM's name parse for one build: the same answers (errors not
    memoised), restored afterwards, and a mapper whose repr is not its content is not memoised."""
    import dataclasses

    calls: list[tuple[str, bool]] = []

    def parse_fine_tuned_lora_name(name: str, weights_mapper: object = None) -> tuple[str, bool]:
        calls.append((name, weights_mapper is not None))
        if name.endswith("bad"):
            raise ValueError(f"{name} is unsupported LoRA weight")
        prefix = weights_mapper.prefix if weights_mapper is not None else ""  # type: ignore[attr-defined]
        return prefix + name.rsplit(".", 2)[0], name.endswith("lora_A.weight")

    scope = {"parse_fine_tuned_lora_name": parse_fine_tuned_lora_name}

    class LoRAModel:
        @classmethod
        def from_lora_tensors(cls, names: list[str], mapper: object) -> list[object]:
            return [scope["parse_fine_tuned_lora_name"](n, mapper) for n in names] + [scope["parse_fine_tuned_lora_name"](n) for n in names]

    # Its globals are a private scope (as vLLM's module is to it), not this test module's.
    func = LoRAModel.from_lora_tensors.__func__
    LoRAModel.from_lora_tensors = classmethod(type(func)(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__))  # type: ignore[method-assign]

    @dataclasses.dataclass
    class Mapper:
        prefix: str

    names = ["m.layers.0.q.lora_A.weight", "m.layers.0.q.lora_B.weight"]
    memos: dict = {}
    parsed = []
    for mapper in (Mapper("x."), Mapper("x."), Mapper("y.")):  # equal mappers share a memo
        calls.clear()
        with parsed_names(LoRAModel, mapper, memos):
            got = LoRAModel.from_lora_tensors(names, mapper)
        assert got == [(mapper.prefix + n.rsplit(".", 2)[0], n.endswith("lora_A.weight")) for n in names] + [(n.rsplit(".", 2)[0], n.endswith("lora_A.weight")) for n in names]
        assert scope["parse_fine_tuned_lora_name"] is parse_fine_tuned_lora_name  # restored
        parsed.append(list(calls))
    every = [(n, True) for n in names] + [(n, False) for n in names]
    assert parsed == [every, [], every]  # vLLM's parse ran once per name and mapper
    with pytest.raises(ValueError, match="unsupported"), parsed_names(LoRAModel, Mapper("x."), memos):
        LoRAModel.from_lora_tensors(["m.bad"], Mapper("x."))
    assert scope["parse_fine_tuned_lora_name"] is parse_fine_tuned_lora_name

    class Opaque:  # repr names the object, not its content: never memoised
        prefix = "z."

    calls.clear()
    for _ in range(2):
        with parsed_names(LoRAModel, Opaque(), memos):
            LoRAModel.from_lora_tensors(names[:1], Opaque())
    assert len(calls) == 4


def test_owned_copy_handles_tensors_that_are_not_one_run() -> None:
    base = torch.arange(64, dtype=torch.float32)
    tensors = {
        "strided": base.view(8, 8).t(),  # not contiguous
        "gap_a": base[0:8].view(2, 4),
        "gap_b": base[16:24].view(2, 4),  # same storage, not adjacent
        "other": torch.ones(3, 3, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4),
    }
    copies = owned_copy(tensors, torch.bfloat16)
    for key, t in tensors.items():
        assert torch.equal(copies[key], t.to(torch.bfloat16)), key
        assert copies[key].shape == t.shape


class _Weights:
    def __init__(self, b: torch.Tensor, scaling: float) -> None:
        self.lora_b, self.scaling = b, scaling


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fold_scaling_is_vllms_optimize_bit_for_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    scales = [2.0, 0.125, 1 / 3, 1.0, 16 / 7]
    loras = {f"layers.{i}.q_proj": _Weights(torch.randn(64, 16, generator=g).to(dtype), scales[i % len(scales)]) for i in range(20)}
    loras["layers.0.mlp.experts.0.gate_proj"] = _Weights(torch.randn(4, 4).to(dtype), 2.0)  # left to vLLM
    want = {}
    for name, w in loras.items():
        b = w.lora_b.clone()
        if ".experts" not in name and w.scaling != 1:
            b *= w.scaling  # LoRALayerWeights.optimize
        want[name] = b
    expected = sum(1 for n, w in loras.items() if ".experts" not in n and w.scaling != 1)
    assert fold_scaling(loras) == expected == 16
    for name, w in loras.items():
        assert torch.equal(w.lora_b, want[name]), name
        assert w.scaling == 1 or ".experts" in name
    assert loras["layers.0.mlp.experts.0.gate_proj"].scaling == 2.0


def test_fold_scaling_leaves_a_scale_it_cannot_match_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    from lorasync.engines.vllm import _build

    monkeypatch.setattr(_build, "_EXACT", {("cpu", torch.bfloat16, 0.5): False})
    b = torch.randn(8, 4).to(torch.bfloat16)
    loras = {"layers.0.q_proj": _Weights(b.clone(), 0.5), "layers.0.k_proj": _Weights(b.clone(), 2.0)}
    assert fold_scaling(loras) == 1
    assert loras["layers.0.q_proj"].scaling == 0.5 and torch.equal(loras["layers.0.q_proj"].lora_b, b)  # vLLM's optimize scales it
    assert loras["layers.0.k_proj"].scaling == 1 and torch.equal(loras["layers.0.k_proj"].lora_b, b * 2.0)
