"""The ``dev128:`` lanes of a word buffer on a GPU in one fused pass (Triton).

Written by hand for speed: the torch form in :mod:`lorasync.wire.device_hash` runs each lane as
about a dozen elementwise kernels (add, three xor-shifts, two multiplies, a sum), so a 175 MB
adapter moves through GPU memory some 60 times: 5-7 ms of the publish's critical path on an
H100 (``benchmarks/results/issue34-h100-b``). This kernel reads every word once, mixes both lanes
in registers and writes one partial sum per block and lane; the sum of the partials is taken by
torch. Sums modulo 2**64 are order-free, so the value is the torch form's, bit for bit
(``tests/gpu/test_device_hash_gpu.py`` compares them on every shape it tries).

:func:`lanes_fused` answers ``None`` where it cannot run (no Triton, not a CUDA tensor); the caller
then takes the torch form.
"""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Any

import torch

from lorasync.errors import LoraSyncWarning

__all__ = ["lanes_fused"]

#: Words per program; 8 warps. One 64 MiB chunk (8 Mi words) is 1024 programs.
BLOCK = 8192


def lanes_fused(words: torch.Tensor, offset: int, seeds: tuple[int, int]) -> torch.Tensor | None:
    """The two lanes' sums of ``words`` (int64, 1-D, contiguous, on a CUDA device) whose first
    word is word ``offset`` of the whole message, as a 2-element int64 tensor on that device
    (wrapped modulo 2**64), or ``None`` when the kernel cannot run here.

    Args:
        words: the message's next words.
        offset: how many words came before them (positions enter the mix).
        seeds: the two lanes' seeds.

    Returns:
        `torch.Tensor | None`: ``[lane0, lane1]``, or ``None``.
    """
    if words.device.type != "cuda" or _BROKEN or words.dtype != torch.int64 or words.dim() != 1 or not words.is_contiguous():
        return None  # the kernel reads one flat run of 64-bit words
    try:
        with _on_device(words.device):
            return _run(words, offset, seeds)
    except Exception as exc:
        if _device_fault(exc):
            raise  # out of memory, a CUDA fault: the torch form would meet it too; never hidden
        # Triton compiles its launcher with the host's C compiler and the kernel for this GPU on
        # first use; where either fails (no compiler, an unsupported GPU) every hash still has to
        # be taken, so this process keeps to the torch form and says so once.
        with _LOCK:
            first = not _BROKEN
            _BROKEN.append(repr(exc))
        if first:
            warnings.warn(
                f"lorasync: the fused GPU hash kernel could not run here ({exc!r:.300}); content hashes are taken with "
                "torch's elementwise kernels instead (the same values, slower)",
                LoraSyncWarning,
                stacklevel=3,
            )
        return None


def _device_fault(exc: BaseException) -> bool:
    """An error of the device itself rather than of building or launching the kernel."""
    if isinstance(exc, torch.OutOfMemoryError) or type(exc).__name__ == "AcceleratorError":
        return True
    text = str(exc)
    return "CUDA error" in text or "CUDA out of memory" in text or "cudaError" in text


_LOCK = threading.Lock()
#: Why the fused kernel failed in this process (empty while it works).
_BROKEN: list[str] = []


def _on_device(device: torch.device) -> Any:
    return torch.cuda.device(device)


def _run(words: torch.Tensor, offset: int, seeds: tuple[int, int]) -> torch.Tensor | None:
    # Also what the CPU tests call under TRITON_INTERPRET=1 (Triton's interpreter runs the kernel on
    # host tensors), so the kernel's arithmetic is checked where no GPU is.
    kernel = _kernel()
    if kernel is None:
        return None
    n = words.numel()
    programs = max(1, -(-n // BLOCK))
    partial = torch.empty((programs, 2), dtype=torch.int64, device=words.device)
    kernel[(programs,)](words, partial, n, offset, seeds[0], seeds[1], BLOCK=BLOCK, num_warps=8)
    return partial.sum(dim=0)  # int64 addition wraps: the sums modulo 2**64


@functools.cache
def _kernel() -> Any:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    # n and offset change with every chunk and adapter: not specialised on (divisible by 16, equal
    # to 1), so one compiled kernel serves every publish instead of a compile in the middle of one.
    @triton.jit(do_not_specialize=["n", "offset"])
    def lanes_kernel(words, partial, n, offset, seed0, seed1, BLOCK: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = idx < n
        w = tl.load(words + idx, mask=mask, other=0).to(tl.uint64, bitcast=True)
        # Position (1-based, over the whole message) times the golden-ratio increment, modulo 2**64.
        pos = (idx + offset + 1).to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15
        zero = tl.zeros((BLOCK,), dtype=tl.uint64)
        z0 = w + pos + seed0.to(tl.uint64, bitcast=True)
        z0 = (z0 ^ (z0 >> 30)) * 0xBF58476D1CE4E5B9
        z0 = (z0 ^ (z0 >> 27)) * 0x94D049BB133111EB
        z0 = z0 ^ (z0 >> 31)
        z1 = w + pos + seed1.to(tl.uint64, bitcast=True)
        z1 = (z1 ^ (z1 >> 30)) * 0xBF58476D1CE4E5B9
        z1 = (z1 ^ (z1 >> 27)) * 0x94D049BB133111EB
        z1 = z1 ^ (z1 >> 31)
        s0 = tl.sum(tl.where(mask, z0, zero), axis=0)
        s1 = tl.sum(tl.where(mask, z1, zero), axis=0)
        tl.store(partial + tl.program_id(0) * 2, s0.to(tl.int64, bitcast=True))
        tl.store(partial + tl.program_id(0) * 2 + 1, s1.to(tl.int64, bitcast=True))

    return lanes_kernel
