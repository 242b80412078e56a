"""Device-to-host export of GPU tensors: one pinned host buffer, one synchronisation.

``tensor.cpu()`` per tensor waits for the GPU once per tensor; for an adapter of ~500 small
tensors that is ~50x slower than one copy of the same bytes. :func:`serialize` instead

1. lays the tensors out as a safetensors file (8-byte header length, JSON header, raw data) in
   one page-locked host buffer (torch's caching host allocator, so repeated exports reuse it);
2. orders the data section in *groups*: tensors of one dtype whose dimensions after the first
   agree (an adapter has three: every ``lora_A`` of one input width, and every ``lora_B``), so a
   group is gathered on the device with one ``cat`` along dim 0 and cut back into views with
   one ``split``, never one Python-level call per tensor;
3. on the caller's current stream (so after the work queued there), gathers each group in
   pieces (growing from 8 MiB to 32 MiB) and copies each piece to its slice of the host buffer
   asynchronously;
4. writes the header and cuts the host views while the transfers run, then waits once per device.

The layout is cached per structure (keys, shapes, dtypes, metadata): a trainer exports the same
adapter shape at every step. The result is already a valid safetensors file (the format allows
data in any order): writing it to disk or into a shared-memory segment is one memcpy
(:meth:`HostBuffer.write_to`, :meth:`HostBuffer.to_shm`), and its tensors are views into the
buffer (:func:`to_host` wraps them back into an :class:`Adapter`). :func:`plan_views` finds the
same groups in any safetensors header, which is how CUDA IPC consumers cut their views.

This module imports only the standard library and torch (plus lorasync's own codec tables): it
also runs inside engine processes.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import operator
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from lorasync.transports._shm import _DTYPES, _FROM_NAME, ShmSegment, write_segment

if TYPE_CHECKING:
    from lorasync._adapter import Adapter

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "Group",
    "HostBuffer",
    "Layout",
    "Piece",
    "ViewPlan",
    "apply_views",
    "gather_into",
    "header_json",
    "layout",
    "plan_views",
    "prefix",
    "serialize",
    "to_host",
    "to_shm_segment",
    "views",
]

#: Bytes gathered on the device per transfer: large enough for full link bandwidth and few
#: host-side launches, small enough that the first transfer starts early.
DEFAULT_CHUNK_BYTES = 32 * 1024 * 1024
#: The first piece copied to the host: its transfer (~0.15 ms at ~55 GB/s) must outlast queuing
#: the next piece on the host (~0.1 ms measured on the H200's host); later pieces grow.
_FIRST_PIECE = 8 * 1024 * 1024
_recent: dict[tuple[tuple[str, str], ...], Layout] = {}  # metadata -> layout of the latest export (see serialize)
_ITEMSIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _DTYPES}
_quote = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]  # the C encoder
# Attribute getters looped in C: per-tensor Python calls add up over hundreds of tensors.
_SHAPE, _DTYPE, _IS_CUDA = map(operator.attrgetter, ("shape", "dtype", "is_cuda"))


class Group(NamedTuple):
    """Tensors of one dtype sharing every dimension after the first, adjacent in a data section.

    Viewed as one ``(sum(rows), *trailing)`` block, the group is one ``cat`` of its tensors along
    dim 0 and ``split(rows)`` gives them back. 0-D tensors form groups of their own (``scalar``):
    one row each, viewed back with shape ``()``.
    """

    begin: int  # byte offset in the data section
    nbytes: int
    dtype: torch.dtype
    trailing: tuple[int, ...]
    rows: tuple[int, ...]
    keys: tuple[str, ...]
    scalar: bool = False

    def block(self, section: torch.Tensor) -> torch.Tensor:
        """This group's bytes in the ``uint8`` data section ``section``, as one
        ``(sum(rows), *trailing)`` tensor of its dtype (a view)."""
        raw = section[self.begin : self.begin + self.nbytes]
        return raw.view(self.dtype).view(sum(self.rows), *self.trailing)


class ViewPlan(NamedTuple):
    """Validated views of a safetensors header, reusable for every buffer with that header."""

    end: int  # the data section must hold at least this many bytes
    groups: tuple[Group, ...]
    copies: tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...]  # misaligned: (key, dtype, shape, begin, nbytes), copied


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
    """Where a set of tensors goes in a safetensors file (from :func:`layout`, cached).

    Attributes:
        header: the JSON header text.
        prefix: the file's first bytes (length and padded header) as a ``uint8`` tensor.
        nbytes: bytes of the data section after ``prefix``.
        plan: the groups (data order) and how to view them.
        members: per group, the positions of its tensors in the caller's mapping.
        order: per tensor of the caller's mapping, its position in data order.
        probe: what :func:`_probe` sees of the tensors this layout was made for.
    """

    header: str
    prefix: torch.Tensor
    nbytes: int
    plan: ViewPlan
    members: tuple[tuple[int, ...], ...]
    order: tuple[int, ...]
    probe: tuple[Any, ...]
    _pieces: dict[tuple[int, int], tuple[Piece, ...]] = field(default_factory=dict, repr=False)

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


def header_json(entries: Iterable[tuple[str, torch.dtype, Sequence[int], int, int]], metadata: Mapping[str, str] | None = None) -> str:
    """The safetensors JSON header for ``(key, dtype, shape, begin, end)`` entries.

    Written as text directly (hundreds of small dicts through ``json.dumps`` cost more).
    """
    parts = [f'"__metadata__":{json.dumps(dict(metadata), separators=(",", ":"))}'] if metadata else []
    for key, dtype, shape, begin, end in entries:
        dims = ",".join(map(str, shape))
        parts.append(f'{_quote(key)}:{{"dtype":"{_DTYPES[dtype]}","shape":[{dims}],"data_offsets":[{begin},{end}]}}')
    return "{" + ",".join(parts) + "}"


def prefix(header: str) -> bytes:
    """The file's first bytes: header length (8 bytes, little-endian) and the JSON header,
    padded with spaces to 8-byte alignment as safetensors does."""
    raw = header.encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def layout(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> Layout:
    """The safetensors layout of ``tensors``: header, groups and where each tensor goes.

    Data is ordered by element size, largest first (every tensor starts aligned to its element
    size and can be viewed in place), then grouped by dtype and trailing dimensions in order of
    first appearance, each group keeping the given order.

    Raises:
        TypeError: a dtype safetensors cannot hold.
    """
    values = tensors.values()
    return _layout(tuple(tensors), tuple(map(_SHAPE, values)), tuple(map(_DTYPE, values)), _meta_key(metadata))


def _meta_key(metadata: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((metadata or {}).items()))


def _probe(keys: tuple[str, ...], shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype]) -> tuple[Any, ...]:
    """A cheap look at a structure (count, first and last key and shape, first dtype): whether
    guessing the last export's layout is worth starting. Only the ends of ``shapes`` and the
    start of ``dtypes`` are read."""
    if not keys:
        return ()
    return (len(keys), keys[0], keys[-1], shapes[0], shapes[-1], dtypes[0])


@functools.lru_cache(maxsize=16)
def _layout(keys: tuple[str, ...], shapes: tuple[torch.Size, ...], dtypes: tuple[torch.dtype, ...], meta: tuple[tuple[str, str], ...]) -> Layout:
    classes: dict[tuple[torch.dtype, bool, tuple[int, ...]], list[int]] = {}
    for i, (key, shape, dtype) in enumerate(zip(keys, shapes, dtypes)):
        if dtype not in _DTYPES:
            raise TypeError(f"{key}: dtype {dtype} has no safetensors encoding")
        classes.setdefault((dtype, len(shape) == 0, tuple(shape[1:])), []).append(i)
    groups, members, entries = [], [], []
    offset = 0
    for (dtype, scalar, trailing), indices in sorted(classes.items(), key=lambda kv: -_ITEMSIZE[kv[0][0]]):
        rows = tuple(1 if scalar else shapes[i][0] for i in indices)
        row_bytes = math.prod(trailing) * _ITEMSIZE[dtype]
        begin = offset
        for i, n in zip(indices, rows):
            entries.append((keys[i], dtype, shapes[i], offset, offset + n * row_bytes))
            offset += n * row_bytes
        groups.append(Group(begin, offset - begin, dtype, trailing, rows, tuple(keys[i] for i in indices), scalar))
        members.append(tuple(indices))
    text = header_json(entries, dict(meta))
    head = torch.frombuffer(bytearray(prefix(text)), dtype=torch.uint8)
    order = [0] * len(keys)
    for position, i in enumerate(itertools.chain.from_iterable(members)):
        order[i] = position
    return Layout(text, head, offset, ViewPlan(offset, tuple(groups), ()), tuple(members), tuple(order), _probe(keys, shapes, dtypes))


@dataclass(frozen=True)
class HostBuffer:
    """Tensors laid out as one safetensors file in one host buffer.

    Attributes:
        data: ``uint8`` tensor holding the whole file (page-locked when CUDA is available).
        tensors: key → view into ``data`` (no copies); keep them and ``data`` stays alive.
        metadata: the header's ``__metadata__``.
    """

    data: torch.Tensor
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def write_to(self, path: str | os.PathLike[str]) -> int:
        """Write the safetensors file to ``path`` in one write; bytes written.

        Raises:
            OSError: from the filesystem.
        """
        with open(path, "wb") as f:
            return f.write(memoryview(self.data.numpy()))

    def to_shm(self) -> ShmSegment:
        """Copy the file into a new shared-memory segment (one memcpy); the caller releases it.

        The segment is what :func:`lorasync.transports._shm.read_segment` reads.
        """
        shm = shared_memory.SharedMemory(create=True, size=max(1, self.nbytes))
        try:
            if self.nbytes:
                dst = torch.frombuffer(shm.buf, dtype=torch.uint8, count=self.nbytes)
                dst.copy_(self.data)
                del dst  # release the export of shm.buf so the segment can be closed later
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        return ShmSegment(name=shm.name, nbytes=self.nbytes, _shm=shm)


def serialize(
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> HostBuffer:
    """Copy ``tensors`` (any mix of CUDA and CPU) into one host buffer in safetensors layout.

    Args:
        tensors (`Mapping[str, torch.Tensor]`): what to export; CUDA work queued on each tensor's
            device's current stream before the call is waited for, never anything queued later.
        metadata (`Mapping[str, str]`, *optional*): the header's ``__metadata__``.
        chunk_bytes (`int`, defaults to 32 MiB): tensors of a group are gathered on their device
            into pieces of up to this size (the first ones smaller, see :meth:`Layout.pieces`),
            each copied to the host in one transfer. ``0`` copies each tensor on its own (no
            extra GPU memory).

    Returns:
        `HostBuffer`: the file bytes and views of each tensor (in the given order), valid once
        this returns.

    Raises:
        TypeError: a dtype safetensors cannot hold.
    """
    buffer, done = _export(tensors, metadata, chunk_bytes)
    for event in done:
        event.synchronize()
    return buffer


def _export(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None, chunk_bytes: int) -> tuple[HostBuffer, list[torch.cuda.Event]]:
    """:func:`serialize` up to the wait: the buffer (header written, views cut) and the events
    its transfers end with; nothing in it may be read before they have."""
    values = list(tensors.values())
    keys, meta = tuple(tensors), _meta_key(metadata)
    pinned = any(map(_IS_CUDA, values))
    guess, started = _recent.get(meta) if pinned else None, None
    if guess is not None and guess.probe == _probe(keys, (values[0].shape, values[-1].shape), (values[0].dtype,)):
        # Queue the transfers with the layout of the last export of this kind (a trainer exports
        # the same structure at every step) and look the layout up while they run: the lookup
        # costs as much host time as queuing the first pieces. A wrong guess is dropped, and its
        # copies overwritten, before anything is returned.
        try:
            started = _start(guess, values, chunk_bytes, pinned)
        except Exception:  # noqa: BLE001 - tensors that do not fit the guess; redone below
            started = None
    plan = _layout(keys, tuple(map(_SHAPE, values)), tuple(map(_DTYPE, values)), meta)
    if started is None or plan is not guess:
        started = _start(plan, values, chunk_bytes, pinned)
    if pinned:
        if len(_recent) >= 16:
            _recent.clear()
        _recent[meta] = plan
    data, done = started
    start = plan.prefix.numel()
    # Host work, overlapping the transfers.
    data[:start].copy_(plan.prefix)
    cut = _cut(data[start:], plan.plan.groups)
    return HostBuffer(data=data, tensors=dict(zip(tensors, map(cut.__getitem__, plan.order))), metadata=dict(metadata or {})), done


def _start(plan: Layout, values: list[torch.Tensor], chunk_bytes: int, pinned: bool) -> tuple[torch.Tensor, list[torch.cuda.Event]]:
    """A host buffer for ``plan`` with the copies of ``values`` into it queued."""
    start = plan.prefix.numel()
    data = torch.empty(start + plan.nbytes, dtype=torch.uint8, pin_memory=pinned)
    # A dropped buffer is safe to free at once: the caching host allocator reuses pinned memory
    # only after the copies queued into it have finished.
    return data, gather_into(data[start:], plan, values, chunk_bytes=chunk_bytes)


def gather_into(section: torch.Tensor, plan: Layout, values: Sequence[torch.Tensor], *, chunk_bytes: int) -> list[torch.cuda.Event]:
    """Queue the copies of ``values`` (the tensors ``plan`` was made for, in its order) into the
    ``uint8`` data section ``section``, piece by piece.

    Everything runs on each device's current stream, after the work the caller queued there:
    a piece of CUDA tensors is gathered with one kernel and, into (pinned) host memory, copied
    with one asynchronous transfer; into device memory it is gathered in place. Host tensors are
    copied before this returns. Returns one event per CUDA device marking the end of its copies
    (none into device memory: later work on the stream is ordered after them).
    """
    indices = set(map(torch.Tensor.get_device, values))  # ints (-1: host): no device objects
    mixed, to_host = len(indices) > 1, section.device.type == "cpu"
    with torch.no_grad():
        for piece in plan.pieces(chunk_bytes, _FIRST_PIECE if to_host else None):
            dst = section[piece.begin : piece.begin + piece.nbytes].view(piece.dtype).view(piece.shape)
            parts = list(map(values.__getitem__, piece.members))
            if mixed and any(t.device != parts[0].device for t in parts):
                for t, slot in zip(parts, dst.split(piece.rows)):  # tensor by tensor
                    _copy(slot, [t], piece.scalar)
            else:
                _copy(dst, parts, piece.scalar)
        events = []
        for index in indices if to_host else ():
            if index >= 0:
                events.append(torch.cuda.Event())
                events[-1].record(torch.cuda.current_stream(index))
    return events


def to_host(adapter: Adapter, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Adapter:
    """``adapter`` with every tensor in host memory, exported with :func:`serialize`.

    Returns ``adapter`` itself when nothing is on a GPU. The new adapter's tensors are views of
    one page-locked buffer laid out as ``adapter_model.safetensors``.
    """
    if not any(t.is_cuda for t in adapter.tensors.values()):
        return adapter
    buffer, done = _export(adapter.tensors, None, chunk_bytes)
    host = adapter._with_tensors(buffer.tensors)  # while the transfers run
    for event in done:
        event.synchronize()
    return host


def to_shm_segment(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> ShmSegment:
    """A shared-memory segment (safetensors layout) holding ``tensors``, wherever they live.

    CPU tensors are copied straight in; GPU tensors go through :func:`serialize` (one transfer per
    device, one wait) and then one memcpy into the segment.
    """
    if any(t.is_cuda for t in tensors.values()):
        return serialize(tensors, metadata).to_shm()
    return write_segment(tensors, metadata)


def plan_views(header: Mapping[str, Any]) -> ViewPlan:
    """Validate a safetensors ``header`` and plan its views (see :func:`views`).

    Adjacent entries of one dtype whose dimensions after the first agree form one
    :class:`Group` (cut with one ``split``); entries not aligned to their element size are
    copied instead.

    Raises:
        ValueError: an unknown dtype, a bad shape or offsets that do not fit it.
    """
    items: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []
    key = ""
    try:
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dtype = _FROM_NAME[info["dtype"]]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            if type(begin) is not int or type(end) is not int or not 0 <= begin <= end:
                raise ValueError(f"bad offsets {begin}..{end}")
            if not all(type(d) is int and d >= 0 for d in shape):
                raise ValueError(f"bad shape {list(shape)}")
            if end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
                raise ValueError(f"offsets {begin}..{end} do not fit shape {list(shape)}")
            items.append((key, dtype, shape, begin, end - begin))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"bad safetensors header entry {key!r}: {exc}") from exc
    items.sort(key=lambda item: item[3])
    runs: list[list[tuple[str, torch.dtype, tuple[int, ...], int, int]]] = []
    copies = []
    for item in items:
        _, dtype, shape, begin, _ = item
        if begin % _ITEMSIZE[dtype]:
            copies.append(item)
            continue
        last = runs[-1][-1] if runs else None
        if last is not None and last[3] + last[4] == begin and last[1] == dtype and _kind(last[2]) == _kind(shape):
            runs[-1].append(item)
        else:
            runs.append([item])
    groups = tuple(
        Group(
            begin=run[0][3],
            nbytes=sum(it[4] for it in run),
            dtype=run[0][1],
            trailing=run[0][2][1:],
            rows=tuple(it[2][0] if it[2] else 1 for it in run),
            keys=tuple(it[0] for it in run),
            scalar=not run[0][2],
        )
        for run in runs
    )
    return ViewPlan(end=max((it[3] + it[4] for it in items), default=0), groups=groups, copies=tuple(copies))


def apply_views(flat: torch.Tensor, plan: ViewPlan) -> dict[str, torch.Tensor]:
    """The tensors of ``plan`` inside the ``uint8`` data section ``flat`` (views, in data order).

    Raises:
        ValueError: ``flat`` is shorter than the plan needs.
    """
    if plan.end > flat.numel():
        raise ValueError(f"the header needs {plan.end} data bytes, the buffer holds {flat.numel()}")
    out = dict(zip(itertools.chain.from_iterable(g.keys for g in plan.groups), _cut(flat, plan.groups)))
    for key, dtype, shape, begin, nbytes in plan.copies:
        out[key] = flat[begin : begin + nbytes].clone().view(dtype).view(shape)
    return out


def views(flat: torch.Tensor, header: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors described by a safetensors ``header`` inside the ``uint8`` data section ``flat``.

    Every entry's offsets are checked against its dtype, shape and ``flat``'s size before any
    view is made; entries not aligned to their element size are copied instead of viewed.

    Raises:
        ValueError: an unknown dtype, a bad shape or offsets outside ``flat``.
    """
    return apply_views(flat, plan_views(header))


# -- internals -----------------------------------------------------------------------------------


def _cut(flat: torch.Tensor, groups: Sequence[Group]) -> list[torch.Tensor]:
    """Views of every tensor of ``groups`` in ``flat``, in data order: one ``split`` per group."""
    out: list[torch.Tensor] = []
    for group in groups:
        parts = group.block(flat).split(group.rows)  # every view cut in one C++ call
        if group.scalar:
            parts = tuple(p.view(()) for p in parts)
        out.extend(parts)
    return out


def _kind(shape: tuple[int, ...]) -> tuple[bool, tuple[int, ...]]:
    """What tensors must share to form one group: being 0-D, and every dimension after the first."""
    return not shape, shape[1:]


def _copy(dst: torch.Tensor, parts: list[torch.Tensor], scalar: bool) -> None:
    """Copy ``parts`` (one device, one dtype, agreeing after dim 0) into the block ``dst``; CUDA
    work on the current stream."""
    if len(parts) == 1:
        dst.view(parts[0].shape).copy_(parts[0], non_blocking=True)
    elif dst.device == parts[0].device:
        (torch.stack if scalar else torch.cat)(parts, out=dst)
    else:
        # One gather kernel, then one transfer: small transfers are dominated by their fixed
        # cost, one large one runs at the link's bandwidth. Into pinned memory the copy is
        # asynchronous; the gathered piece is freed stream-ordered, after the copy has read it.
        dst.copy_(torch.stack(parts) if scalar else torch.cat(parts), non_blocking=True)
