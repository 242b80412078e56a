"""The safetensors layout: plan it once, write it anywhere, read it back, or view it in place.

The format is safetensors' own (8-byte little-endian header length, JSON header padded with
spaces to 8-byte alignment, raw data), so ``safetensors`` reads every buffer and file lorasync
writes, and lorasync reads files safetensors wrote. The verbs:

* **plan** (:func:`plan`): where every tensor goes, cached per structure (a trainer publishes the
  same keys and shapes at every step). ``grouped=True`` orders the data section in *groups* —
  tensors of one dtype whose dimensions after the first agree, largest element size first — so a
  group is gathered with one ``cat`` and cut back with one ``split`` (the device-to-host and
  CUDA IPC paths). ``grouped=False`` keeps the caller's order (files, shared-memory segments and
  the torch.distributed buffer: the bytes lorasync has always written).
* **write** (:meth:`Layout.write_into` a ``uint8`` buffer, :meth:`Layout.write_file` a file):
  each tensor's memory is copied once, straight from the tensor.
* **read** lives in :mod:`lorasync.wire.reading` (bounds-checked copies out of any buffer) and
  **view** in :mod:`lorasync.wire.views` (tensors as views into a data section).

Ground floor: imports only the standard library, torch, numpy and :mod:`lorasync.errors`; it
also runs inside engine processes.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import operator
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, NamedTuple

import torch

from lorasync.errors import WireFormatError
from lorasync.wire.dtypes import ITEMSIZE, name_of
from lorasync.wire.views import ViewPlan, cut_groups, group_entries, raw_bytes

__all__ = ["Layout", "Piece", "fingerprint", "header_json", "plan", "prefix"]

_quote = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]  # the C encoder
# Attribute getters looped in C: per-tensor Python calls add up over hundreds of tensors.
_SHAPE, _DTYPE = map(operator.attrgetter, ("shape", "dtype"))


class Piece(NamedTuple):
    """Tensors of one group gathered and copied as one: ``nbytes`` at byte ``begin`` of the data
    section, viewed as ``shape``; ``members`` are their positions in the caller's mapping."""

    begin: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    rows: tuple[int, ...]
    members: tuple[int, ...]
    scalar: bool


@dataclass(frozen=True, eq=False)
class Layout:
    """Where a set of tensors goes in a safetensors file (from :func:`plan`, cached).

    Attributes:
        header: the JSON header text.
        prefix: the file's first bytes (length and padded header) as a ``uint8`` tensor.
        nbytes: bytes of the data section after ``prefix``.
        plan: the groups (data order) and how to view them.
        members: per group, the positions of its tensors in the caller's mapping.
        order: per tensor of the caller's mapping, its position in data order.
        spans: per tensor of the caller's mapping, ``(begin, end)`` in the data section.
        fingerprint: what :func:`fingerprint` sees of the tensors this layout was made for.
    """

    header: str
    prefix: torch.Tensor
    nbytes: int
    plan: ViewPlan
    members: tuple[tuple[int, ...], ...]
    order: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    fingerprint: tuple[Any, ...]
    _pieces: dict[tuple[int, int], tuple[Piece, ...]] = field(default_factory=dict, repr=False)

    @property
    def total(self) -> int:
        """Bytes of the whole file: prefix plus data section."""
        return self.prefix.numel() + self.nbytes

    def write_into(self, out: torch.Tensor, values: Sequence[torch.Tensor]) -> None:
        """Copy the prefix and ``values`` (the tensors this layout was planned for, in their
        order) into ``out``, a 1-D ``uint8`` tensor of at least :attr:`total` elements on any
        device; each tensor is copied once.

        Raises:
            WireFormatError: ``out`` is not such a tensor.
        """
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < self.total:
            raise WireFormatError(f"need a 1-D uint8 tensor of at least {self.total} elements, got {out.dtype} {tuple(out.shape)}")
        start = self.prefix.numel()
        out[:start].copy_(self.prefix)
        # CPU to CPU: a plain memcpy through numpy; torch's copy_ hands every tensor to an
        # OpenMP pool, which costs more than the copy for adapter-sized tensors (measured 6x).
        host = out.numpy() if out.device.type == "cpu" else None
        for (begin, end), tensor in zip(self.spans, values):
            if end == begin:
                continue
            src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            if host is not None and src.device.type == "cpu":
                host[start + begin : start + end] = src.numpy()
            else:
                out[start + begin : start + end].copy_(src)

    def write_file(self, f: IO[bytes], values: Sequence[torch.Tensor]) -> int:
        """Write the file to the open binary file ``f``: the prefix, then each tensor's memory
        handed straight to ``write`` (no staging copy). ``values`` must be CPU-contiguous and
        ordered by data position (``grouped=False`` layouts: the caller's order).

        Returns:
            Bytes written.
        """
        written = f.write(self.prefix.numpy())
        for (begin, end), tensor in zip(self.spans, values):
            if end > begin:
                written += f.write(raw_bytes(tensor))
        return written

    def pieces(self, chunk_bytes: int, first_bytes: int | None = None) -> tuple[Piece, ...]:
        """The groups cut into pieces of at most ``chunk_bytes`` to gather and copy as one.

        With ``first_bytes``, pieces grow from that size, each at most as large as everything
        before it: the first transfer starts after a small gather, later ones are few. A tensor
        larger than the limit forms a piece alone; ``chunk_bytes=0`` makes every tensor its own
        piece. Pieces without bytes are left out. Cached.
        """
        first_bytes = chunk_bytes if first_bytes is None else min(first_bytes, chunk_bytes)
        cached = self._pieces.get((chunk_bytes, first_bytes))
        if cached is None:
            out: list[Piece] = []
            queued = 0
            for group, members in zip(self.plan.groups, self.members):
                row_bytes = group.nbytes // max(sum(group.rows), 1)
                if not row_bytes:
                    continue
                bounds, size = [0], 0
                for i, rows in enumerate(group.rows):
                    if i > bounds[-1] and size + rows * row_bytes > min(chunk_bytes, max(first_bytes, queued)):
                        bounds.append(i)
                        queued += size
                        size = 0
                    size += rows * row_bytes
                queued += size
                bounds.append(len(group.rows))
                begin = group.begin
                for first, stop in itertools.pairwise(bounds):
                    rows = group.rows[first:stop]
                    nbytes = sum(rows) * row_bytes
                    if nbytes:
                        out.append(Piece(begin, nbytes, group.dtype, (sum(rows), *group.trailing), rows, members[first:stop], group.scalar))
                    begin += nbytes
            cached = self._pieces[chunk_bytes, first_bytes] = tuple(out)
        return cached

    def cut(self, section: torch.Tensor) -> list[torch.Tensor]:
        """Views of every tensor in the ``uint8`` data section ``section``, in the caller's
        order (one ``split`` per group). Only for layouts without misaligned entries."""
        data_order = cut_groups(section, self.plan.groups)
        return list(map(data_order.__getitem__, self.order))


def header_json(entries: Iterable[tuple[str, torch.dtype, Sequence[int], int, int]], metadata: Mapping[str, str] | None = None) -> str:
    """The safetensors JSON header for ``(key, dtype, shape, begin, end)`` entries.

    Written as text directly (hundreds of small dicts through ``json.dumps`` cost more).
    ``__metadata__`` is written when ``metadata`` is not None (even when empty).

    Raises:
        UnsupportedDtypeError: a dtype the format cannot name.
    """
    parts = [f'"__metadata__":{json.dumps(dict(metadata), separators=(",", ":"))}'] if metadata is not None else []
    for key, dtype, shape, begin, end in entries:
        dims = ",".join(map(str, shape))
        parts.append(f'{_quote(key)}:{{"dtype":"{name_of(dtype, key=key)}","shape":[{dims}],"data_offsets":[{begin},{end}]}}')
    return "{" + ",".join(parts) + "}"


def prefix(header: str) -> bytes:
    """The file's first bytes: header length (8 bytes, little-endian) and the JSON header,
    padded with spaces to 8-byte alignment as safetensors does."""
    raw = header.encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def plan(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None, *, grouped: bool = True) -> Layout:
    """The safetensors layout of ``tensors``: header, groups and where each tensor goes.

    Args:
        tensors (`Mapping[str, torch.Tensor]`): any device; only keys, shapes and dtypes are read.
        metadata (`Mapping[str, str]`, *optional*): the header's ``__metadata__``.
        grouped (`bool`, defaults to `True`): order data by element size, largest first (every
            tensor aligned to its element size, viewable in place), then by dtype and trailing
            dimensions in order of first appearance, each group keeping the given order. With
            `False` the data keeps the caller's order and adjacent tensors of one kind form the
            groups (misaligned ones are only copied, never viewed).

    Raises:
        UnsupportedDtypeError: a dtype safetensors cannot hold.
    """
    values = tensors.values()
    meta = None if metadata is None else tuple(sorted(metadata.items()))
    return _plan(tuple(tensors), tuple(map(_SHAPE, values)), tuple(map(_DTYPE, values)), meta, grouped)


def fingerprint(keys: tuple[str, ...], shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype]) -> tuple[Any, ...]:
    """A cheap look at a structure (count, first and last key and shape, first dtype): whether
    guessing the last layout is worth starting. Only the ends of ``shapes`` and the start of
    ``dtypes`` are read."""
    if not keys:
        return ()
    return (len(keys), keys[0], keys[-1], shapes[0], shapes[-1], dtypes[0])


@functools.lru_cache(maxsize=32)
def _plan(
    keys: tuple[str, ...],
    shapes: tuple[torch.Size, ...],
    dtypes: tuple[torch.dtype, ...],
    meta: tuple[tuple[str, str], ...] | None,
    grouped: bool,
) -> Layout:
    for key, dtype in zip(keys, dtypes):
        name_of(dtype, key=key)  # raises for a dtype the format cannot hold
    if grouped:
        classes: dict[tuple[torch.dtype, bool, tuple[int, ...]], list[int]] = {}
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            classes.setdefault((dtype, len(shape) == 0, tuple(shape[1:])), []).append(i)
        ordered = sorted(classes.values(), key=lambda idx: -ITEMSIZE[dtypes[idx[0]]])
        positions = list(itertools.chain.from_iterable(ordered))
    else:
        positions = list(range(len(keys)))
    spans = [(0, 0)] * len(keys)
    entries = []
    offset = 0
    for i in positions:
        n = math.prod(shapes[i]) * ITEMSIZE[dtypes[i]]
        spans[i] = (offset, offset + n)
        entries.append((keys[i], dtypes[i], tuple(shapes[i]), offset, n))
        offset += n
    view_plan = group_entries(entries)
    index = {key: i for i, key in enumerate(keys)}
    members = tuple(tuple(index[k] for k in g.keys) for g in view_plan.groups)
    order = [0] * len(keys)
    for position, i in enumerate(itertools.chain.from_iterable(members)):
        order[i] = position
    text = header_json(((k, d, s, b, b + n) for k, d, s, b, n in entries), None if meta is None else dict(meta))
    head = torch.frombuffer(bytearray(prefix(text)), dtype=torch.uint8)
    return Layout(text, head, offset, view_plan, members, tuple(order), tuple(spans), fingerprint(keys, shapes, dtypes))

