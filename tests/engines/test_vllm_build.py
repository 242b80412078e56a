"""The worker's batched build (engines/vllm/_build.py) gives exactly what vLLM's per-tensor build
gives: the same casts, the same scaled lora_B, bit for bit, and copies that share nothing with
the staged snapshot vLLM rebuilds evicted adapters from."""

from __future__ import annotations

import pytest
import torch

from lorasync.engines.vllm._build import fold_scaling, owned_copy
from lorasync.wire.shm import read_segment, write_segment


def _staged(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """An adapter as a worker stages it: views into one shared-memory copy, A and B interleaved."""
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for layer in range(3):
        for module, (out_f, in_f) in {"q_proj": (48, 32), "k_proj": (16, 32), "down_proj": (32, 80)}.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(8, in_f, generator=g).to(dtype)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, 8, generator=g).to(dtype)
    segment = write_segment(tensors, {})
    try:
        staged, _ = read_segment(segment.name, segment.nbytes)
    finally:
        segment.release()
    return staged


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16, torch.float16, None])
def test_owned_copy_is_the_per_tensor_cast_and_owns_its_memory(source: torch.dtype, target: torch.dtype | None) -> None:
    staged = _staged(source)
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
