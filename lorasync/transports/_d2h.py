"""Device-to-host export of GPU tensors: one pinned host buffer, one synchronisation.

``tensor.cpu()`` per tensor waits for the GPU once per tensor; for an adapter of ~500 small
tensors that is ~50x slower than one copy of the same bytes. :func:`serialize` instead

1. lays the tensors out as a safetensors file (8-byte header length, JSON header, raw data) in
   one page-locked host buffer (torch's caching host allocator, so repeated exports reuse it);
2. on a side stream that first waits for the caller's current stream, gathers the tensors of
   each device into pieces of a few MiB (one concatenation kernel each) and copies each piece to
   its slice of the host buffer asynchronously, so gathering overlaps the transfers;
3. writes the header and cuts the host views while the transfers run, then waits once per device.

For the common case (one GPU, one dtype: an adapter) the header is cached per structure: a
trainer exports the same keys and shapes at every step. What remains on the host is a few
microseconds per tensor of view bookkeeping (docs/benchmarks-gpu.md has the numbers).

The result is already a valid safetensors file: writing it to disk or into a shared-memory
segment is one memcpy (:meth:`HostBuffer.write_to`, :meth:`HostBuffer.to_shm`), and its tensors
are views into the buffer (:func:`to_host` wraps them back into an :class:`Adapter`).

This module imports only the standard library and torch (plus lorasync's own codec tables): it
also runs inside engine processes.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from lorasync.transports._shm import _DTYPES, _FROM_NAME, ShmSegment, write_segment

if TYPE_CHECKING:
    from lorasync._adapter import Adapter

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "HostBuffer",
    "header_json",
    "apply_views",
    "layout",
    "plan_views",
    "prefix",
    "serialize",
    "to_host",
    "to_shm_segment",
    "views",
]

#: Bytes gathered on the device per transfer: large enough for full link bandwidth, small enough
#: that gathering the next piece overlaps the transfer of the last (and bounds extra GPU memory).
DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024
_ITEMSIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _DTYPES}
_quote = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]  # the C encoder


class Entry(NamedTuple):
    """One tensor's place in the data section (offsets relative to the data start)."""

    key: str
    tensor: torch.Tensor
    begin: int
    nbytes: int


def header_json(entries: Iterable[tuple[str, torch.dtype, Sequence[int], int, int]], metadata: Mapping[str, str] | None = None) -> str:
    """The safetensors JSON header for ``(key, dtype, shape, begin, end)`` entries.

    Written as text directly (hundreds of small dicts through ``json.dumps`` cost more).
    """
    parts = [f'"__metadata__":{json.dumps(dict(metadata), separators=(",", ":"))}'] if metadata else []
    for key, dtype, shape, begin, end in entries:
        dims = ",".join(map(str, shape))
        parts.append(f'{_quote(key)}:{{"dtype":"{_DTYPES[dtype]}","shape":[{dims}],"data_offsets":[{begin},{end}]}}')
    return "{" + ",".join(parts) + "}"


def layout(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> tuple[str, list[Entry]]:
    """The safetensors JSON header and the data entries in data order.

    Data is ordered by element size, largest first, so every tensor starts at an offset aligned
    to its element size and can be viewed in place.

    Raises:
        TypeError: a dtype safetensors cannot hold.
    """
    order = list(tensors.items())
    if len({t.dtype for _, t in order}) > 1:
        order.sort(key=lambda kv: -kv[1].element_size())  # stable: keeps given order per size
    entries: list[Entry] = []
    offset = 0
    for key, tensor in order:
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"{key}: dtype {tensor.dtype} has no safetensors encoding")
        nbytes = tensor.numel() * _ITEMSIZE[tensor.dtype]
        entries.append(Entry(key, tensor, offset, nbytes))
        offset += nbytes
    text = header_json(((e.key, e.tensor.dtype, e.tensor.shape, e.begin, e.begin + e.nbytes) for e in entries), metadata)
    return text, entries


def prefix(header: str) -> bytes:
    """The file's first bytes: header length (8 bytes, little-endian) and the JSON header,
    padded with spaces to 8-byte alignment as safetensors does."""
    raw = header.encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


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
        chunk_bytes (`int`, defaults to 8 MiB): small tensors are gathered on their device into
            pieces of up to this size, each copied to the host in one transfer while the next is
            gathered. ``0`` copies each tensor on its own (no extra GPU memory).

    Returns:
        `HostBuffer`: the file bytes and views of each tensor, valid once this returns.

    Raises:
        TypeError: a dtype safetensors cannot hold.
    """
    values = list(tensors.values())
    if values and all(t.is_cuda for t in values) and len({(t.device, t.dtype) for t in values}) == 1:
        if values[0].dtype not in _DTYPES:
            raise TypeError(f"dtype {values[0].dtype} has no safetensors encoding")
        return _serialize_one_kind(list(tensors), values, metadata, chunk_bytes)

    header, entries = layout(tensors, metadata)
    head = prefix(header)
    start = len(head)
    total = start + sum(e.nbytes for e in entries)
    data = torch.empty(total, dtype=torch.uint8, pin_memory=any(t.is_cuda for t in values))
    by_device: dict[torch.device, list[Entry]] = {}
    host: list[Entry] = []
    for entry in entries:
        if entry.nbytes == 0:
            continue
        if entry.tensor.is_cuda:
            by_device.setdefault(entry.tensor.device, []).append(entry)
        else:
            host.append(entry)
    section = data[start:]
    done = [_launch(section, device, group, chunk_bytes) for device, group in by_device.items()]
    # Everything below runs on the host while the GPU transfers are in flight.
    data[:start].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    with torch.no_grad():
        for entry in host:
            _slot(section, entry).copy_(entry.tensor)
    out = apply_views(section, plan_views(json.loads(header)))
    for event in done:
        event.synchronize()
    return HostBuffer(data=data, tensors={k: out[k] for k in tensors}, metadata=dict(metadata or {}))


def to_host(adapter: Adapter, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Adapter:
    """``adapter`` with every tensor in host memory, exported with :func:`serialize`.

    Returns ``adapter`` itself when nothing is on a GPU. The new adapter's tensors are views of
    one page-locked buffer laid out as ``adapter_model.safetensors``.
    """
    if not any(t.is_cuda for t in adapter.tensors.values()):
        return adapter
    return adapter._with_tensors(serialize(adapter.tensors, chunk_bytes=chunk_bytes).tensors)


def to_shm_segment(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> ShmSegment:
    """A shared-memory segment (safetensors layout) holding ``tensors``, wherever they live.

    CPU tensors are copied straight in; GPU tensors go through :func:`serialize` (one transfer per
    device, one wait) and then one memcpy into the segment.
    """
    if any(t.is_cuda for t in tensors.values()):
        return serialize(tensors, metadata).to_shm()
    return write_segment(tensors, metadata)


class ViewPlan(NamedTuple):
    """Validated views of a safetensors header, reusable for every buffer with that header."""

    end: int  # the data section must hold at least this many bytes
    runs: tuple[tuple[int, int, torch.dtype, tuple[str, ...], tuple[torch.Tensor, ...]], ...]  # aligned, adjacent, one dtype: (begin, end, dtype, keys, meta templates)
    copies: tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...]  # misaligned: copied


def plan_views(header: Mapping[str, Any]) -> ViewPlan:
    """Validate a safetensors ``header`` and plan its views (see :func:`views`).

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
            if end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
                raise ValueError(f"offsets {begin}..{end} do not fit shape {list(shape)}")
            items.append((key, dtype, shape, begin, end - begin))
        items.sort(key=lambda item: item[3])
        runs, copies = [], []
        i = 0
        while i < len(items):
            key, dtype, shape, begin, nbytes = items[i]
            if begin % _ITEMSIZE[dtype]:
                copies.append(items[i])
                i += 1
                continue
            j, end = i + 1, begin + nbytes
            while j < len(items) and items[j][1] == dtype and items[j][3] == end:
                end += items[j][4]
                j += 1
            run = items[i:j]
            # Shape templates on the meta device (no memory): the views are cut in one C++ call.
            templates = tuple(torch.empty(it[2], dtype=dtype, device="meta") for it in run)
            runs.append((begin, end, dtype, tuple(it[0] for it in run), templates))
            i = j
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        # RuntimeError: torch refusing a shape (negative or non-integer dimensions).
        raise ValueError(f"bad safetensors header entry {key!r}: {exc}") from exc
    return ViewPlan(end=max((it[3] + it[4] for it in items), default=0), runs=tuple(runs), copies=tuple(copies))


def apply_views(flat: torch.Tensor, plan: ViewPlan) -> dict[str, torch.Tensor]:
    """The tensors of ``plan`` inside the ``uint8`` data section ``flat`` (views, in data order).

    Raises:
        ValueError: ``flat`` is shorter than the plan needs.
    """
    if plan.end > flat.numel():
        raise ValueError(f"the header needs {plan.end} data bytes, the buffer holds {flat.numel()}")
    from torch._utils import _unflatten_dense_tensors

    out: dict[str, torch.Tensor] = {}
    for begin, end, dtype, keys, templates in plan.runs:
        section = flat[begin:end].view(dtype)
        for key, template, view in zip(keys, templates, _unflatten_dense_tensors(section, list(templates))):
            # unflatten gives empty tensors a fresh (0,) tensor: restore their shape.
            out[key] = view if template.numel() else section.new_empty(template.shape)
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


def _slot(section: torch.Tensor, entry: Entry) -> torch.Tensor:
    """``entry``'s bytes in ``section``, viewed as its dtype and shape."""
    raw = section[entry.begin : entry.begin + entry.nbytes]
    return raw.view(entry.tensor.dtype).view(entry.tensor.shape)


def _runs(group: list[Entry], chunk_bytes: int) -> Iterator[list[Entry]]:
    """Consecutive entries of one dtype, adjacent in the buffer, at most ``chunk_bytes`` together
    (a larger single entry forms a run alone)."""
    run: list[Entry] = []
    size = 0
    for entry in group:
        joins = bool(run) and run[-1].begin + run[-1].nbytes == entry.begin and run[-1].tensor.dtype == entry.tensor.dtype
        if run and (not joins or size + entry.nbytes > chunk_bytes):
            yield run
            run, size = [], 0
        run.append(entry)
        size += entry.nbytes
    if run:
        yield run


def _gather(dst: torch.Tensor, run: list[Entry]) -> None:
    """Copy ``run`` (one dtype, adjacent) into ``dst`` (its slots, flat, same dtype): one kernel
    on the device or one copy."""
    if len(run) == 1:
        dst.view(run[0].tensor.shape).copy_(run[0].tensor, non_blocking=True)
    else:
        torch.cat([e.tensor.reshape(-1) for e in run], out=dst)


def _flatten(run: list[Entry]) -> torch.Tensor:
    return _flatten_tensors([e.tensor for e in run])


def _flatten_tensors(values: list[torch.Tensor]) -> torch.Tensor:
    """``values`` concatenated into a new flat tensor, flattened in C++ (not hundreds of
    Python-level reshapes); one gather kernel on the device."""
    from torch._utils import _flatten_dense_tensors

    return _flatten_dense_tensors(values)


@functools.lru_cache(maxsize=16)
def _plan(keys: tuple[str, ...], shapes: tuple[torch.Size, ...], dtype: torch.dtype, meta: tuple[tuple[str, str], ...]) -> tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """Header text, file prefix (as a tensor), offsets and element counts of one-dtype tensors in
    the given order. Cached: a trainer exports the same structure at every step."""
    itemsize = _ITEMSIZE[dtype]
    numels = tuple(math.prod(shape) for shape in shapes)
    offsets = tuple(itertools.accumulate((n * itemsize for n in numels), initial=0))
    text = header_json(zip(keys, itertools.repeat(dtype), shapes, offsets, offsets[1:]), dict(meta))
    return text, torch.frombuffer(bytearray(prefix(text)), dtype=torch.uint8), offsets, numels


def _one_kind_plan(keys: list[str], values: list[torch.Tensor], metadata: Mapping[str, str] | None) -> tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    return _plan(tuple(keys), tuple(t.shape for t in values), values[0].dtype, tuple(sorted((metadata or {}).items())))


def _host_views(section: torch.Tensor, values: list[torch.Tensor]) -> list[torch.Tensor]:
    from torch._utils import _unflatten_dense_tensors

    out = list(_unflatten_dense_tensors(section, values))  # views, cut in C++
    for i, t in enumerate(values):
        if t.numel() == 0:  # unflatten gives empty tensors a fresh (0,) tensor
            out[i] = section.new_empty(t.shape)
    return out


def _serialize_one_kind(keys: list[str], values: list[torch.Tensor], metadata: Mapping[str, str] | None, chunk_bytes: int) -> HostBuffer:
    """Tensors all on one GPU in one dtype (an adapter): the transfers start first; the prefix is
    written and the host views are cut while they run."""
    dtype, device = values[0].dtype, values[0].device
    _, head, offsets, numels = _one_kind_plan(keys, values, metadata)
    start = head.numel()
    buf = torch.empty(start + offsets[-1], dtype=torch.uint8, pin_memory=True)
    section = buf[start:].view(dtype)
    done = _launch_pieces(section, values, numels, device, chunk_bytes)
    # Host work, overlapping the transfers.
    buf[:start].copy_(head)
    out = _host_views(section, values)
    done.synchronize()
    return HostBuffer(data=buf, tensors=dict(zip(keys, out)), metadata=dict(metadata or {}))


def _launch_pieces(section: torch.Tensor, values: list[torch.Tensor], numels: Sequence[int], device: torch.device, chunk_bytes: int) -> torch.cuda.Event:
    """Queue ``values`` (one GPU, ``section``'s dtype) into the pinned ``section`` in order,
    gathered into pieces of up to ``chunk_bytes``; an event marks the end."""
    limit = max(chunk_bytes // section.element_size(), 1)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.no_grad():
        i, start, n = 0, 0, len(values)
        while i < n:
            j, count = i + 1, numels[i]
            while j < n and count + numels[j] <= limit:
                count += numels[j]
                j += 1
            dst = section[start : start + count]
            if j - i == 1:
                if count:
                    dst.view(values[i].shape).copy_(values[i], non_blocking=True)
            else:
                # Pinned destination: asynchronous; the gathered piece is freed stream-ordered
                # on ``side``, so its memory is reused only after the transfer has read it.
                dst.copy_(_flatten_tensors(values[i:j]), non_blocking=True)
            start += count
            i = j
        event = torch.cuda.Event()
        event.record(side)
    return event


def _launch(section: torch.Tensor, device: torch.device, group: list[Entry], chunk_bytes: int) -> torch.cuda.Event:
    """Queue the copies of ``group`` (tensors on ``device``) into the pinned ``section``; an event
    marks their end."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.no_grad():
        for run in _runs(group, chunk_bytes):
            first = run[0]
            nbytes = sum(e.nbytes for e in run)
            dst = section[first.begin : first.begin + nbytes].view(first.tensor.dtype)
            if len(run) == 1:
                _gather(dst, run)
            else:
                # One gather kernel into a staging buffer, then one transfer: small transfers are
                # dominated by their fixed cost, one large one runs at the link's bandwidth.
                # Pinned destination: the copy is asynchronous; the staging buffer is freed
                # stream-ordered on ``side``, so it is reused only after the copy has read it.
                dst.copy_(_flatten(run), non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    return event
