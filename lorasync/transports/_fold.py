"""Fold LoRA deltas into pristine base weights, streamed in buckets of bounded size."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from lorasync._adapter import Adapter
from lorasync.transports._base_weights import BaseWeights

__all__ = ["fold_buckets", "fold_module"]


def fold_module(
    adapter: Adapter, module: str, base: BaseWeights, *, device: str | torch.device | None = None, block_bytes: int = 32 << 20
) -> torch.Tensor:
    """``W0 + scale·B·A`` for ``module`` in W0's dtype, computed in float32 and rounded once, on
    ``device`` (default: where W0 is); the result stays there.

    W0 travels to ``device`` alone and in its own dtype. The rank-r product is formed in float32
    in row blocks of at most ``block_bytes`` and added to W0 by one elementwise pass that writes
    the result in W0's dtype, so the extra memory is one float32 block, never a float32 copy of
    the weight. (cuBLAS's fused 16-bit ``addmm`` would round ``s·B·A`` to 16 bits before adding
    it, which loses precision where W0 and the delta cancel.)
    """
    w0 = base.get(f"{module}.weight")
    a, b = adapter.pair(module)
    dev = torch.device(device) if device is not None else w0.device
    w0 = w0.to(device=dev, non_blocking=True)
    a32 = a.to(device=dev, dtype=torch.float32)
    b32 = b.to(device=dev, dtype=torch.float32)
    scale = adapter.config.scale_for(module)
    out = torch.empty_like(w0)
    rows = max(1, block_bytes // (4 * max(1, w0.shape[1])))
    for start in range(0, w0.shape[0], rows):
        stop = min(start + rows, w0.shape[0])
        delta = torch.mm(b32[start:stop], a32)
        # Float32 arithmetic (type promotion), written straight into W0's dtype.
        torch.add(w0[start:stop], delta, alpha=scale, out=out[start:stop])
    return out


def _units(modules: Iterable[str], fused: Sequence[Sequence[str]]) -> list[list[str]]:
    """Group modules so fused siblings (q/k/v → qkv_proj) travel together and complete."""
    sibling = {leaf: tuple(group) for group in fused for leaf in group}
    units: dict[str, list[str]] = {}
    for module in sorted(modules):
        prefix, _, leaf = module.rpartition(".")
        group = sibling.get(leaf)
        if group is None:
            units[module] = [module]
        else:
            units.setdefault(f"{prefix}.{group}", [f"{prefix}.{g}" if prefix else g for g in group])
    return list(units.values())


def fold_buckets(
    adapter: Adapter | None,
    base: BaseWeights,
    *,
    bucket_bytes: int,
    restore: Iterable[str] = (),
    fused: Sequence[Sequence[str]] = (),
    device: str | torch.device | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield ``{param_name: merged_weight}`` buckets of at most ``bucket_bytes`` (one unit may
    exceed it alone).

    Modules in ``restore`` (touched by an earlier merge, not by ``adapter``) get their pristine
    W0 back. ``fused`` lists leaf groups an engine stores as one tensor (vLLM: q/k/v, gate/up):
    a touched member brings its whole group, never split across buckets, untouched members as W0.
    """
    touched = set(adapter.modules) if adapter is not None else set()
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for unit in _units(touched | set(restore), fused):
        # Flush before folding when the unit would overflow the bucket: peak stays ~1 bucket
        # plus one unit, never two full buckets plus a unit.
        unit_bytes = sum(base.nbytes(f"{m}.weight") for m in unit)
        if bucket and size + unit_bytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        weights = {}
        for module in unit:
            name = f"{module}.weight"
            if adapter is not None and module in touched:
                weights[name] = fold_module(adapter, module, base, device=device)
            else:
                weights[name] = base.get(name)
        bucket.update(weights)
        size += unit_bytes
    if bucket:
        yield bucket
