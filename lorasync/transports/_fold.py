"""Fold LoRA deltas into pristine base weights, streamed in buckets of bounded size."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from lorasync._adapter import Adapter
from lorasync.transports._base_weights import BaseWeights

__all__ = ["fold_buckets", "fold_module"]


def fold_module(adapter: Adapter, module: str, base: BaseWeights, *, device: str | torch.device | None = None) -> torch.Tensor:
    """``W0 + scale·B·A`` for ``module`` in W0's dtype, computed in float32 (on ``device``)."""
    w0 = base.get(f"{module}.weight")
    a, b = adapter.pair(module)
    dev = device if device is not None else w0.device
    acc = w0.to(device=dev, dtype=torch.float32, copy=True)
    # addmm_ in place: one float32 buffer per module, no separate delta tensor.
    acc.addmm_(b.to(device=dev, dtype=torch.float32), a.to(device=dev, dtype=torch.float32), alpha=adapter.config.scale_for(module))
    return acc.to(w0.dtype)


def fold_buckets(
    adapter: Adapter | None,
    base: BaseWeights,
    *,
    bucket_bytes: int,
    restore: Iterable[str] = (),
    device: str | torch.device | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield ``{param_name: merged_weight}`` buckets of at most ``bucket_bytes`` (one module may
    exceed it alone). Modules in ``restore`` (touched by an earlier merge, not by ``adapter``)
    get their pristine W0 back."""
    touched = list(adapter.modules) if adapter is not None else []
    plan = [(m, True) for m in touched] + [(m, False) for m in sorted(set(restore) - set(touched))]
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for module, fold in plan:
        name = f"{module}.weight"
        weight = fold_module(adapter, module, base, device=device) if fold and adapter is not None else base.get(name)
        nbytes = weight.numel() * weight.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = weight
        size += nbytes
    if bucket:
        yield bucket
