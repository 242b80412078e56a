"""Fold LoRA deltas into pristine base weights, streamed in buckets of bounded size.

On a GPU each module is one fused GEMM kernel (:mod:`lorasync.transports._fold_gpu`: ``B·A`` in
float32, W0 added, rounded once, W0 read and W written once); the CPU, and a GPU without Triton,
take the blocked float32 path below, bit for bit as before.

MoE experts: a per-expert module (``mlp.experts.3.gate_proj``) folds into
``<module>.weight`` when the base has it (a checkpoint on disk), else into its rows of the fused
3-D parameter (``mlp.experts.gate_up_proj[3, :I]``, the transformers-5 model's own tensors), which
then travels whole, with every expert of it (:func:`lorasync.adapter._moe.fused_rows`).

Fan-out: :class:`SharedFold` runs one fold for every engine of a publish that needs the same
buckets (same adapter, same modules to restore, same fused layout) and hands each bucket to all
of them; a bucket is dropped once every engine has taken it, so memory grows only with how far
the slowest engine lags behind the fastest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from lorasync.adapter._adapter import Adapter
from lorasync.adapter._moe import fused_rows
from lorasync.transports._base_weights import BaseWeights
from lorasync.transports._fold_gpu import fold_fused

__all__ = ["SharedFold", "fold_buckets", "fold_experts", "fold_module"]


def fold_module(
    adapter: Adapter, module: str, base: BaseWeights, *, device: str | torch.device | None = None, block_bytes: int = 32 << 20
) -> torch.Tensor:
    """``W0 + scale·B·A`` for ``module`` in W0's dtype, computed in float32 and rounded once, on
    ``device`` (default: where W0 is); the result stays there.

    On a GPU: one fused kernel (module docstring). Otherwise W0
    travels to ``device`` alone and in its own dtype; the rank-r product is formed in float32 in
    row blocks of at most ``block_bytes`` and added to W0 by one elementwise pass that writes the
    result in W0's dtype, so the extra memory is one float32 block, never a float32 copy of the
    weight.
    """
    return _fold(adapter, module, base.get(f"{module}.weight"), device=device, block_bytes=block_bytes)


def _fold(adapter: Adapter, module: str, w0: torch.Tensor, *, device: str | torch.device | None, block_bytes: int = 32 << 20) -> torch.Tensor:
    a, b = adapter.pair(module)
    if adapter.is_embedding(module):
        # An embedding's weight is [num_embeddings, dim] and its delta (B·A)^T = A^T·B^T: the same
        # fold with the factors swapped and transposed.
        a, b = b.T, a.T
    dev = torch.device(device) if device is not None else w0.device
    scale = adapter.config.scale_for(module)
    if dev.type == "cuda":
        fused = fold_fused(w0, a, b, scale, dev)
        if fused is not None:
            return fused
    w0 = w0.to(device=dev, non_blocking=True)
    a32 = a.to(device=dev, dtype=torch.float32)
    b32 = b.to(device=dev, dtype=torch.float32)
    out = torch.empty_like(w0)
    rows = max(1, block_bytes // (4 * max(1, w0.shape[1])))
    for start in range(0, w0.shape[0], rows):
        stop = min(start + rows, w0.shape[0])
        delta = torch.mm(b32[start:stop], a32)
        # Float32 arithmetic (type promotion), written straight into W0's dtype.
        torch.add(w0[start:stop], delta, alpha=scale, out=out[start:stop])
    return out


def fold_experts(adapter: Adapter, name: str, modules: Iterable[str], base: BaseWeights, *, device: str | torch.device | None = None) -> torch.Tensor:
    """The fused expert parameter ``name`` (``[E, out, in]``) with every per-expert module of
    ``modules`` folded into its rows (each as :func:`fold_module` folds a weight), on ``device``."""
    w0 = base.get(name)
    dev = torch.device(device) if device is not None else w0.device
    out = w0.to(device=dev, copy=True)
    for module in modules:
        _, expert, index, leaves = fused_rows(module)  # type: ignore[misc]
        rows = w0.shape[1] // leaves
        out[expert, index * rows : (index + 1) * rows] = _fold(adapter, module, w0[expert, index * rows : (index + 1) * rows], device=dev)
    return out


def _weight_of(module: str, base: BaseWeights) -> str:
    """The base parameter ``module``'s delta lands in: ``<module>.weight``, or the fused expert
    parameter a per-expert module is rows of when the base has only that one."""
    name = f"{module}.weight"
    if name not in base:
        where = fused_rows(module)
        if where is not None and where[0] in base:
            return where[0]
    return name


def _units(modules: Iterable[str], fused: Sequence[Sequence[str]], base: BaseWeights) -> list[dict[str, list[str]]]:
    """Group modules by the base parameter they land in (fused experts: one parameter for all of
    them), and parameters so fused siblings (q/k/v → qkv_proj) travel together and complete."""
    sibling = {leaf: tuple(group) for group in fused for leaf in group}
    units: dict[str, dict[str, list[str]]] = {}
    for module in sorted(modules):
        name = _weight_of(module, base)
        prefix, _, leaf = module.rpartition(".")
        group = sibling.get(leaf) if name == f"{module}.weight" else None
        if group is None:
            units.setdefault(name, {}).setdefault(name, []).append(module)
        else:
            unit = units.setdefault(f"{prefix}.{group}", {f"{prefix}.{g}.weight" if prefix else f"{g}.weight": [] for g in group})
            unit[name].append(module)
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
    base.check_pristine()
    touched = set(adapter.modules) if adapter is not None else set()
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for unit in _units(touched | set(restore), fused, base):
        # Flush before folding when the unit would overflow the bucket: peak stays ~1 bucket
        # plus one unit, never two full buckets plus a unit.
        unit_bytes = sum(base.nbytes(name) for name in unit)
        if bucket and size + unit_bytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        weights = {}
        for name, modules in unit.items():
            folded = [m for m in modules if m in touched]
            if adapter is None or not folded:
                weights[name] = base.get(name)
            elif name == f"{folded[0]}.weight":
                weights[name] = fold_module(adapter, folded[0], base, device=device)
            else:
                weights[name] = fold_experts(adapter, name, folded, base, device=device)
        bucket.update(weights)
        size += unit_bytes
    if bucket:
        yield bucket


Bucket = dict[str, torch.Tensor]


class SharedFold:
    """One ``fold_buckets`` stream read by several consumers (thread-safe).

    Every consumer calls :meth:`join` before the first bucket is folded (a consumer arriving later
    gets ``None`` and folds on its own); each reader yields every bucket once, in order. The
    first reader to ask for a bucket folds it while the others wait; a reader that stops early
    (an engine failed) leaves, so the buckets it will not take are not kept for it. A failing
    fold raises its error to every reader that has not got all buckets.

    Args:
        make: starts the fold (``lambda: fold_buckets(...)``), called once, on first use.
    """

    def __init__(self, make: Callable[[], Iterator[Bucket]]) -> None:
        self._make = make
        self._stream: Iterator[Bucket] | None = None
        self._lock = threading.Lock()
        self._held: dict[int, list[Any]] = {}  # index -> [bucket, readers still to take it]
        self._readers = 0
        self._folded = 0  # buckets folded so far
        self._end: int | None = None  # index of the end, once reached
        self._error: BaseException | None = None  # the fold's failure, raised to every reader
        self.folds = 0  # times the fold was started (1 when shared)

    def join(self) -> _Reader | None:
        """A reader of the shared buckets, or None when folding has already begun."""
        with self._lock:
            if self._stream is not None:
                return None
            self._readers += 1
        return _Reader(self)

    def _take(self, index: int) -> Bucket | None:
        with self._lock:
            if self._error is not None and index >= self._folded:
                raise self._error  # never a short stream that looks complete
            if index == self._folded and self._end is None:
                if self._stream is None:
                    self._stream, self.folds = self._make(), self.folds + 1
                try:
                    bucket = next(self._stream, None)
                except BaseException as exc:
                    self._error = exc
                    raise
                if bucket is None:
                    self._end = index
                else:
                    self._held[index] = [bucket, self._readers]
                    self._folded += 1
            if self._end is not None and index >= self._end:
                return None
            entry = self._held[index]
            entry[1] -= 1
            if entry[1] == 0:
                del self._held[index]
            return entry[0]

    def _leave(self, index: int) -> None:
        """The reader that took ``index`` buckets is gone: release its claim on the others."""
        with self._lock:
            self._readers -= 1
            for i in [i for i in self._held if i >= index]:
                self._held[i][1] -= 1
                if self._held[i][1] <= 0:
                    del self._held[i]


class _Reader:
    """One consumer of a :class:`SharedFold`: an iterator of its buckets; ``close()`` leaves
    (also before the first bucket, and implied once the buckets are exhausted)."""

    def __init__(self, fold: SharedFold) -> None:
        self._fold: SharedFold | None = fold
        self._index = 0

    def __iter__(self) -> _Reader:
        return self

    def __next__(self) -> Bucket:
        fold = self._fold
        if fold is None:
            raise StopIteration
        try:
            bucket = fold._take(self._index)
        except BaseException:
            self.close()
            raise
        if bucket is None:
            self.close()
            raise StopIteration
        self._index += 1
        return bucket

    def close(self) -> None:
        """Leave the fold (idempotent): buckets not yet taken are no longer kept for this reader."""
        if self._fold is not None:
            fold, self._fold = self._fold, None
            fold._leave(self._index)
