"""The merged fold on a GPU as one fused GEMM kernel: ``W = W0 + s·B·A``, rounded once.

Written by hand (Triton) for speed and precision together. cuBLAS's fused ``addmm`` reaches the
memory floor but, with a 16-bit output, rounds ``s·B·A`` to 16 bits before adding W0, whatever
PyTorch's reduced-precision flags say (measured on the H200: 4.5 % of a bf16 module's elements
off one rounding where W0 and the delta cancel; ``tests/gpu/test_fold_gpu.py`` fails on it). The
blocked float32 path (product, then an elementwise add) rounds once but moves 12 bytes per bf16
element. This kernel forms each output tile's ``B·A`` in float32 registers (tensor cores for
16-bit factors, IEEE float32 for float32 ones), adds W0 read in its own dtype, and writes W once:
4 bytes per bf16 element, W0 read and W written, no intermediate in memory. W0 that had to travel
to the GPU is a fresh copy, folded in place.

Needs Triton (shipped with PyTorch's CUDA wheels); :func:`fold_fused` answers ``None`` where it
cannot run, and the caller takes the blocked path.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

__all__ = ["fold_fused"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Output tile (rows, columns) and warps; the benchmark measures the alternatives.
CONFIG = (64, 128, 4)


def fold_fused(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dev: torch.device, *, config: tuple[int, int, int] | None = None) -> torch.Tensor | None:
    """``W0 + scale·B·A`` in W0's dtype on ``dev`` (a CUDA device), or ``None`` when the kernel
    cannot run here (no Triton, a dtype or shape it does not take); W0 itself is never written."""
    if w0.dim() != 2 or w0.dtype not in _DTYPES or a.dtype not in _DTYPES or b.dtype not in _DTYPES:
        return None
    kernel = _kernel()
    if kernel is None:
        return None
    with torch.no_grad():
        moved = w0.to(device=dev, non_blocking=True)
        a = a.to(device=dev, non_blocking=True)
        b = b.to(device=dev, non_blocking=True)
        if a.dtype != b.dtype:
            a, b = a.float(), b.float()
        out = moved if moved is not w0 else torch.empty_like(w0, memory_format=torch.contiguous_format)
        m, n = moved.shape
        k = a.shape[0]
        if not (m and n):
            return out
        rows, cols, warps = config or CONFIG
        bk = 16 if k <= 16 else 32
        grid = (-(-m // rows), -(-n // cols))
        with torch.cuda.device(dev):
            kernel[grid](
                moved, b, a, out, m, n, k, float(scale),
                moved.stride(0), moved.stride(1), b.stride(0), b.stride(1), a.stride(0), a.stride(1), out.stride(0), out.stride(1),
                BM=rows, BN=cols, BK=bk, IEEE=a.dtype == torch.float32, num_warps=warps,
            )
    return out


@functools.cache
def _kernel() -> Any:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        warnings.warn("lorasync: Triton is not installed; the GPU fold takes the slower float32 path", RuntimeWarning, stacklevel=3)
        return None

    @triton.jit
    def fold_kernel(w0, b, a, out, M, N, K, scale, s_wm, s_wn, s_bm, s_bk, s_ak, s_an, s_om, s_on, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
        rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            bt = tl.load(b + rm[:, None] * s_bm + rk[None, :] * s_bk, mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            at = tl.load(a + rk[:, None] * s_ak + rn[None, :] * s_an, mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
            if IEEE:
                acc += tl.dot(bt, at, input_precision="ieee")
            else:
                acc += tl.dot(bt, at)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        w = tl.load(w0 + rm[:, None] * s_wm + rn[None, :] * s_wn, mask=mask, other=0.0)
        result = w.to(tl.float32) + scale * acc  # float32, rounded once by the store
        tl.store(out + rm[:, None] * s_om + rn[None, :] * s_on, result.to(out.dtype.element_ty), mask=mask)

    return fold_kernel
