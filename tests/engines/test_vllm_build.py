"""The worker's batched build (engines/vllm/_build.py) gives exactly what vLLM's per-tensor build
gives: the same casts, the same scaled lora_B, bit for bit, and copies that share nothing with
the staged snapshot vLLM rebuilds evicted adapters from."""

from __future__ import annotations

import pytest
import torch

from lorasync.engines.vllm._build import fold_scaling, owned_copy
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


# -- from the outside attack on the one-buffer copy (each was a failing repro) ------------------


def _bypasses() -> list[tuple[str, object]]:
    seven = torch.full((8, 32), 7.0)
    return [
        ("dict.__setitem__", lambda bv, k: dict.__setitem__(bv, k, seven.clone())),
        ("dict.update", lambda bv, k: dict.update(bv, {k: seven.clone()})),
        ("dict.pop then dict.setdefault", lambda bv, k: (dict.pop(bv, k), dict.setdefault(bv, k, seven.clone()))),
        (".data =", lambda bv, k: setattr(bv[k], "data", seven.clone())),
        ("set_", lambda bv, k: bv[k].set_(seven.clone())),
    ]


@pytest.mark.parametrize("how", [name for name, _ in _bypasses()])
def test_a_value_changed_behind_the_dicts_back_is_copied_as_it_is_now(how: str) -> None:
    """A value replaced through dict's own methods, or re-pointed with .data= / set_, is no
    longer a view of the buffer: its copy is what the dict holds now, never the stale buffer."""
    staged = _staged(torch.float32, cut=True)
    key = next(iter(staged))
    dict(_bypasses())[how](staged, key)  # type: ignore[operator]
    copies = owned_copy(staged, None)
    assert list(copies) == list(staged)
    assert all(torch.equal(copies[k], t) for k, t in staged.items()), how


def test_entries_sharing_bytes_get_copies_of_their_own() -> None:
    """Two names over the same bytes (a writer storing tied factors once): each copy owns its
    memory, so vLLM scaling one lora_B in place cannot scale the other a second time."""
    from lorasync.wire.views import views

    b = torch.arange(16, dtype=torch.float32).view(4, 4)
    flat = b.reshape(-1).view(torch.uint8).clone()
    header = {name: {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]} for name in ("m.q.lora_B.weight", "m.k.lora_B.weight")}
    staged = views(flat, header)
    copies = owned_copy(staged, None)
    copies["m.q.lora_B.weight"].mul_(2)
    assert torch.equal(copies["m.k.lora_B.weight"], b)


def test_a_misaligned_entry_edited_in_place_is_copied_as_edited() -> None:
    """Entries the plan had to copy out (misaligned) are not views of the buffer: an in-place edit
    of one shows in its copy."""
    from lorasync.wire.views import views

    flat = torch.zeros(36, dtype=torch.uint8)
    flat[2:18] = torch.arange(4, dtype=torch.float32).view(torch.uint8)
    flat[20:36] = torch.arange(4, 8, dtype=torch.float32).view(torch.uint8)
    header = {"odd": {"dtype": "F32", "shape": [4], "data_offsets": [2, 18]}, "even": {"dtype": "F32", "shape": [4], "data_offsets": [20, 36]}}
    staged = views(flat, header)
    staged["odd"].mul_(10)
    copies = owned_copy(staged, None)
    assert all(torch.equal(copies[k], t) for k, t in staged.items())


def test_a_pickled_one_buffer_dict_comes_back_a_plain_dict() -> None:
    import pickle

    staged = _staged(torch.float32, cut=True)
    back = pickle.loads(pickle.dumps(staged))
    assert type(back) is dict and list(back) == list(staged)
    assert all(torch.equal(back[k], t) for k, t in staged.items())


# -- from the second outside attack ------------------------------------------------------------


@pytest.mark.parametrize("how", ["dict.__setitem__ of a negated view", ".data = a negated view", "the buffer re-pointed", "the buffer replaced", "a subclass view"])
def test_what_the_dict_reads_now_is_what_is_copied(how: str) -> None:
    """Lazily negated views, a section re-pointed or replaced under the dict, and a value of
    another tensor class: the copy reads what the dict reads now."""
    staged = _staged(torch.float32, cut=True)
    key = next(iter(staged))

    class Marked(torch.Tensor):
        pass

    if how == "dict.__setitem__ of a negated view":
        dict.__setitem__(staged, key, torch._neg_view(staged[key]))
    elif how == ".data = a negated view":
        staged[key].data = torch._neg_view(staged[key].detach().clone())
    elif how == "the buffer re-pointed":
        staged.flat.set_(torch.zeros_like(staged.flat))  # type: ignore[union-attr]
    elif how == "the buffer replaced":
        staged.flat = torch.zeros_like(staged.flat)  # type: ignore[arg-type]
    else:
        dict.__setitem__(staged, key, staged[key].as_subclass(Marked))
    copies = owned_copy(staged, None)
    assert all(torch.equal(copies[k], t.resolve_neg()) for k, t in staged.items()), how


def test_only_apply_views_says_a_dict_is_cut_from_a_buffer() -> None:
    staged = _staged(torch.float32, cut=True)
    mine = BufferViews({k: v.clone() for k, v in staged.items()})
    assert mine.flat is None and mine.copy_to() is None


@pytest.mark.parametrize(("source", "target"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float16)])
def test_a_one_buffer_stage_is_cast_whole_as_each_tensor_would_be(source: torch.dtype, target: torch.dtype) -> None:
    """An fp32 adapter (what PEFT trains) staged for a bf16 LoRA dtype: one cast of the whole
    buffer, cut at the moved offsets, equal to casting each tensor (values around rounding ties,
    subnormals, infinities and NaN included)."""
    staged = _staged(source, cut=True)
    edge = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-9, 1e-40, 3.4e38, float("inf"), float("-inf"), float("nan"), -0.0], dtype=torch.float64)
    first = next(iter(staged))
    staged[first].view(-1)[: edge.numel()].copy_(edge.to(source))  # in place: still the buffer's view
    copies = owned_copy(staged, target)
    assert len({t.untyped_storage().data_ptr() for t in copies.values()}) == 1  # one cast, one buffer
    for key, t in staged.items():
        want = t.to(target)
        assert copies[key].dtype == target and copies[key].shape == t.shape
        bits = {2: torch.int16, 4: torch.int32}[target.itemsize]
        assert torch.equal(copies[key].view(bits), want.view(bits)), key  # bit for bit (NaN too)
    copies[first].mul_(0)
    assert not torch.equal(staged[first], copies[first])  # nothing shared with the staged snapshot


def test_a_stage_of_several_dtypes_is_cast_tensor_by_tensor() -> None:
    tensors = {"a": torch.randn(4, 8), "b": torch.randn(8, 4).to(torch.bfloat16), "c": torch.randn(4, 8)}
    layout = plan(tensors, {})
    flat = torch.empty(layout.nbytes, dtype=torch.uint8)
    gather_into(flat, layout, list(tensors.values()), chunk_bytes=layout.nbytes)
    staged = apply_views(flat, _header_plan(layout.header)[0])
    assert staged.copy_to(dtype=torch.float16) is None
    copies = owned_copy(staged, torch.float16)
    assert all(torch.equal(copies[k], t.to(torch.float16)) for k, t in staged.items())


@pytest.mark.parametrize("target", [torch.float8_e4m3fn, torch.complex64, torch.float64])
def test_a_cast_to_any_dtype_copies_exactly_or_falls_back(target: torch.dtype) -> None:
    # Outside attack (23:40 session): a dtype outside the wire's table raised KeyError.
    staged = _staged(torch.float32, cut=True)
    copies = owned_copy(staged, target)
    for key, t in staged.items():
        want = t.to(target)
        assert copies[key].dtype == target and torch.equal(copies[key].view(torch.uint8), want.view(torch.uint8)), key


@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16, None])
def test_a_shared_memory_stage_read_as_one_buffer_is_copied_and_cast_whole(target: torch.dtype | None) -> None:
    """The worker reads a shared-memory stage as one copy of its data (vLLM CPU: the cast of a
    bf16 adapter to fp32 was one kernel per tensor); each build copies it whole, exactly."""
    tensors = _staged(torch.bfloat16)
    segment = write_segment(tensors, {"k": "v"})
    try:
        staged, metadata = read_segment(segment.name, segment.nbytes, one_buffer=True)
    finally:
        segment.release()
    assert metadata == {"k": "v"} and isinstance(staged, BufferViews) and set(staged) == set(tensors)
    assert all(torch.equal(staged[k], t) for k, t in tensors.items())
    copies = owned_copy(staged, target)
    assert len({t.untyped_storage().data_ptr() for t in copies.values()}) == 1
    for key, t in tensors.items():
        assert torch.equal(copies[key], t.to(target or t.dtype)) and copies[key].dtype == (target or t.dtype), key
    copies[key].add_(1)
    assert torch.equal(staged[key], tensors[key])  # the staged snapshot is untouched


@pytest.mark.parametrize("one_buffer", [False, True])
def test_a_truncated_shared_memory_stage_is_refused_either_way(one_buffer: bool) -> None:
    from lorasync.errors import WireFormatError

    segment = write_segment(_staged(torch.float32), {})
    try:
        with pytest.raises(WireFormatError):
            read_segment(segment.name, segment.nbytes - 7, one_buffer=one_buffer)
    finally:
        segment.release()
