"""Merged fold on the GPU: W0 + s·B·A within bf16 rounding of a float64 reference, wherever W0
lives, bucketed exactly like the CPU fold."""

from __future__ import annotations

import pytest
import torch

from lorasync import Adapter, AdapterConfig, BaseWeights
from lorasync.transports._fold import fold_buckets

SHAPES = {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (64, 256), "self_attn.v_proj": (64, 256), "mlp.down_proj": (256, 640)}
FUSED = [("q_proj", "k_proj", "v_proj")]


def _setup(w0_device: str, w0_dtype: torch.dtype, lora_dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    base, tensors = {}, {}
    for i in range(2):
        for name, (out, inp) in SHAPES.items():
            m = f"model.layers.{i}.{name}"
            base[f"{m}.weight"] = torch.randn(out, inp, generator=g).to(w0_dtype).to(w0_device)
            if name.endswith("k_proj"):
                continue  # k comes back pristine as part of the fused q/k/v group
            tensors[f"base_model.model.{m}.lora_A.weight"] = torch.randn(8, inp, generator=g).to(lora_dtype).cuda()
            tensors[f"base_model.model.{m}.lora_B.weight"] = torch.randn(out, 8, generator=g).to(lora_dtype).cuda()
    return base, Adapter(tensors, AdapterConfig(r=8, lora_alpha=24, rank_pattern={"down_proj": 8}, alpha_pattern={"down_proj": 4}))


def _fold(adapter, base, device):
    return [dict(b) for b in fold_buckets(adapter, BaseWeights.from_tensors(base), bucket_bytes=300_000, fused=FUSED, device=device)]


@pytest.mark.parametrize(
    "seed,w0_device,w0_dtype,lora_dtype",
    [
        (1, "cpu", torch.bfloat16, torch.bfloat16),  # W0 streamed to the GPU module by module
        (2, "cuda", torch.bfloat16, torch.bfloat16),
        (3, "cuda", torch.bfloat16, torch.float32),
        (4, "cuda", torch.float16, torch.float16),
    ],
)
def test_gpu_fold_matches_float64_reference(seed, w0_device, w0_dtype, lora_dtype) -> None:
    base, adapter = _setup(w0_device, w0_dtype, lora_dtype, seed=seed)
    merged = {k: v for b in _fold(adapter, base, "cuda") for k, v in b.items()}
    eps = torch.finfo(w0_dtype).eps
    for m in adapter.modules:
        a, b = (t.double().cpu() for t in adapter.pair(m))
        ref = base[f"{m}.weight"].double().cpu() + adapter.config.scale_for(m) * (b @ a)
        got = merged.pop(f"{m}.weight")
        assert got.device.type == "cuda" and got.dtype == w0_dtype
        err = (got.double().cpu() - ref).abs()
        # One rounding to the 16-bit dtype (at most half an ulp, within eps·|ref|) plus float32
        # accumulation noise (absolute, ~1e-6 here); rounding s·B·A to 16 bits first would not pass.
        assert bool((err <= ref.abs() * eps + 1e-4).all()), (m, float(err.max()))
        assert float(err.norm() / ref.norm()) < 4e-3
    # What is left is pristine W0 of fused siblings the adapter does not touch.
    for name, w in merged.items():
        assert name.endswith("k_proj.weight") and torch.equal(w.cpu(), base[name].cpu())


def test_gpu_fold_buckets_like_the_cpu_fold() -> None:
    base, adapter = _setup("cpu", torch.bfloat16, torch.bfloat16, seed=5)
    cpu_adapter = adapter.to(device="cpu")
    gpu = _fold(adapter, base, "cuda")
    cpu = _fold(cpu_adapter, base, None)
    assert [list(b) for b in gpu] == [list(b) for b in cpu]
    for gb, cb in zip(gpu, cpu):
        for name in gb:
            diff = (gb[name].float().cpu() - cb[name].float()).abs()
            assert bool((diff <= cb[name].float().abs() * torch.finfo(torch.bfloat16).eps + 1e-4).all()), name


@pytest.mark.parametrize("w0_device", ["cpu", "cuda"])
def test_gpu_fold_never_writes_w0(w0_device: str) -> None:
    """The fused fold writes in place only into W0's fresh copy on the GPU, never into W0."""
    base, adapter = _setup(w0_device, torch.bfloat16, torch.bfloat16, seed=6)
    pristine = {k: v.clone() for k, v in base.items()}
    first = _fold(adapter, base, "cuda")
    again = _fold(adapter, base, "cuda")
    for name, w in base.items():
        assert torch.equal(w, pristine[name]), name
    for b1, b2 in zip(first, again):
        assert all(torch.equal(b1[k], b2[k]) for k in b1)


def test_gpu_fold_kernel_takes_odd_shapes_ranks_and_strides() -> None:
    """Tile edges (rows and columns not multiples of the tile), ranks below and above 16 (the
    kernel's smallest inner block, and two blocks), a transposed (strided) W0 on the host and
    factors of another dtype than W0: within one rounding of a float64 reference."""
    from lorasync.transports._fold_gpu import fold_fused

    g = torch.Generator().manual_seed(8)
    for out, inp, r, w_dtype, f_dtype in [(100, 72, 4, torch.bfloat16, torch.bfloat16), (257, 130, 40, torch.float16, torch.float16), (33, 300, 16, torch.bfloat16, torch.float32), (64, 48, 8, torch.float32, torch.float32)]:
        w0 = torch.randn(inp, out, generator=g).to(w_dtype).t()  # strided, on the host
        a = torch.randn(r, inp, generator=g).to(f_dtype).cuda()
        b = torch.randn(out, r, generator=g).to(f_dtype).cuda()
        got = fold_fused(w0, a, b, 0.75, torch.device("cuda"))
        assert got is not None and got.dtype == w_dtype and got.device.type == "cuda"
        ref = w0.double() + 0.75 * (b.double().cpu() @ a.double().cpu())
        err = (got.double().cpu() - ref).abs()
        tol = 1e-4 if w_dtype != torch.float32 else 1e-5
        assert bool((err <= ref.abs() * torch.finfo(w_dtype).eps + tol).all()), (out, inp, r, float(err.max()))
