"""The worker's build of a staged adapter, in a few kernels instead of one per tensor.

vLLM builds an adapter (``LoRAModel.from_lora_tensors``, then its manager's pack and
``optimize``) tensor by tensor: a cast of every factor to the LoRA dtype, then ``lora_B *= scaling``
for every module. For Qwen3-8B (504 factors) that is about 750 small kernels and their Python
calls, 9-13 ms of the worker's load on an H200 (``benchmarks/results/issue34-h200/probe-inprocess.json``).
For tensors lorasync staged, which lie side by side in one buffer, the worker instead

* copies (and casts) each run of adjacent same-dtype tensors with one kernel
  (:func:`owned_copy`): exactly the values of a per-tensor ``.to(dtype, copy=True)``, because a
  cast is elementwise; tensors a CUDA IPC stage cut from one buffer are copied (and cast) as that
  one buffer and cut again (no Python per tensor);
* folds the scale into every ``lora_B`` with one ``_foreach_mul_`` per distinct scale
  (:func:`fold_scaling`) and marks the modules scaled, so vLLM's ``optimize`` has nothing left to
  do: the same elementwise ``b * s`` in the tensor's own dtype (both compute in the op-math type
  with the scale cast once), which ``tests/engines/test_vllm_build.py`` checks bit for bit.

Written here rather than taken from vLLM because vLLM has no batched form of either step; the
rest of the build (module names, packing, validation) stays vLLM's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["fold_scaling", "owned_copy"]


def owned_copy(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """A copy of ``tensors`` in ``dtype`` (None: each keeps its own), on their device, that shares
    no memory with them.

    Tensors that lie back to back in one storage, contiguous and of one dtype, are copied as one
    flat run (one kernel); any other tensor on its own.

    Args:
        tensors: name → tensor, typically views into one staged buffer.
        dtype: the dtype of the copies.

    Returns:
        name → copy, in the order of ``tensors``.
    """
    # Tensors a CUDA IPC stage cut from one buffer (wire.views.BufferViews, unchanged since): one
    # copy of that buffer, cast whole where it must be, cut the same way, with no per-tensor
    # Python at all (page-locked where the buffer is).
    copy_to = getattr(tensors, "copy_to", None)
    whole = copy_to(dtype=dtype) if callable(copy_to) else None
    if whole is not None:
        return {name: whole[name] for name in tensors}
    out: dict[str, torch.Tensor] = {}
    runs: list[list[tuple[str, torch.Tensor]]] = []
    ordered = sorted(
        # A lazily negated or conjugated view reads otherwise than its storage: copied on its own.
        ((name, t) for name, t in tensors.items() if t.is_contiguous() and t.numel() and not t.is_neg() and not t.is_conj()),
        key=lambda item: (item[1].untyped_storage().data_ptr(), item[1].storage_offset()),
    )
    for name, t in ordered:
        if runs:
            last = runs[-1][-1][1]
            if (
                last.dtype == t.dtype
                and last.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                and last.storage_offset() + last.numel() == t.storage_offset()
            ):
                runs[-1].append((name, t))
                continue
        runs.append([(name, t)])
    for run in runs:
        first = run[0][1]
        total = sum(t.numel() for _, t in run)
        flat = first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (total,))
        if first.device.type == "cpu" and first.is_pinned():
            # Staged in page-locked memory (vLLM's LoRA cache on a GPU host): so is the copy, which
            # vLLM's build would otherwise pin again tensor by tensor.
            copy = torch.empty(total, dtype=dtype or first.dtype, pin_memory=True).copy_(flat)
        else:
            copy = flat.to(dtype=dtype or first.dtype, copy=True)
        offset = 0
        for name, t in run:
            out[name] = copy[offset : offset + t.numel()].view(t.shape)
            offset += t.numel()
    for name, t in tensors.items():
        if name not in out:
            out[name] = t.to(dtype=dtype or t.dtype, copy=True)
    return {name: out[name] for name in tensors}


def fold_scaling(loras: Mapping[str, Any]) -> int:
    """Multiply every plain module's ``lora_b`` by its ``scaling`` in place, one ``_foreach_mul_``
    per distinct scale, and set ``scaling`` to 1, as vLLM's ``LoRALayerWeights.optimize`` would do
    module by module. Packed (list) factors and fused experts are left to vLLM, and so is every
    module where the batched multiply is not known to round as ``lora_b *= scaling`` does
    (:func:`_batched_is_exact`).

    Args:
        loras: vLLM's ``LoRAModel.loras`` (module name → ``LoRALayerWeights``).

    Returns:
        How many modules were scaled.
    """
    by_scale: dict[tuple[float, torch.device, torch.dtype], list[Any]] = {}
    for name, weights in loras.items():
        b, scale = getattr(weights, "lora_b", None), getattr(weights, "scaling", 1)
        if ".experts" in name or not isinstance(b, torch.Tensor) or isinstance(scale, list) or scale == 1:
            continue
        by_scale.setdefault((float(scale), b.device, b.dtype), []).append(weights)
    scaled = 0
    for (scale, device, dtype), group in by_scale.items():
        if not _batched_is_exact(device, dtype, scale):
            continue  # vLLM's optimize scales them, one by one
        torch._foreach_mul_([w.lora_b for w in group], _scalar(scale))
        for w in group:
            w.scaling = 1
        scaled += len(group)
    return scaled


def _scalar(scale: float) -> torch.Tensor:
    # The 0-dim double tensor overload: on the CPU the Python-float overload of _foreach_mul_
    # rounds differently from ``b *= scale`` (measured: bf16 x 1/3), this one does not.
    return torch.tensor(scale, dtype=torch.float64)


_EXACT: dict[tuple[str, torch.dtype, float], bool] = {}


def _batched_is_exact(device: torch.device, dtype: torch.dtype, scale: float) -> bool:
    """Whether ``_foreach_mul_`` with this scale gives what ``b *= scale`` gives, bit for bit, on
    this kind of device and dtype: tried once per (device type, dtype, scale) on 64 Ki values
    spread over the whole exponent range (a different formula, such as the scale rounded to the
    tensor's dtype first, shows on most of them), and never assumed."""
    key = (device.type, dtype, scale)
    if key not in _EXACT:
        g = torch.Generator().manual_seed(0)
        probe = (torch.randn(1 << 16, generator=g, dtype=torch.float64) * torch.pow(2.0, torch.randint(-30, 30, (1 << 16,), generator=g)))
        probe = probe.to(device=device, dtype=dtype)
        want, got = probe.clone(), [probe.clone()]
        want *= scale
        torch._foreach_mul_(got, _scalar(scale))
        _EXACT[key] = bool(torch.equal(want, got[0]))
    return _EXACT[key]
