"""Device-to-host export of GPU tensors: one pinned host buffer, one synchronisation.

``tensor.cpu()`` per tensor waits for the GPU once per tensor; for an adapter of ~500 small
tensors that is ~60x slower than one copy of the same bytes. :func:`serialize` instead

1. lays the tensors out as a safetensors file (8-byte header length, JSON header, raw data) in
   one page-locked host buffer (torch's caching host allocator, so repeated exports reuse it);
2. on a side stream that first waits for the caller's current stream, gathers the tensors of
   each device into one staging buffer on that device (one concatenation kernel) and copies it to
   its slice of the host buffer with one asynchronous copy;
3. waits once per device.

The result is already a valid safetensors file: writing it to disk or into a shared-memory
segment is one memcpy (:meth:`HostBuffer.write_to`, :meth:`HostBuffer.to_shm`), and its tensors
are views into the buffer (:func:`to_host` wraps them back into an :class:`Adapter`).

This module imports only the standard library and torch (plus lorasync's own codec tables): it
also runs inside engine processes.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, NamedTuple

import torch

from lorasync.transports._shm import _DTYPES, _FROM_NAME, ShmSegment, write_segment

if TYPE_CHECKING:
    from lorasync._adapter import Adapter

__all__ = ["DEFAULT_CHUNK_BYTES", "HostBuffer", "layout", "prefix", "serialize", "to_host", "to_shm_segment", "views"]

#: Upper bound of one device-side staging buffer (extra GPU memory while exporting).
DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024
_ITEMSIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _DTYPES}


class Entry(NamedTuple):
    """One tensor's place in the data section (offsets relative to the data start)."""

    key: str
    tensor: torch.Tensor
    begin: int
    nbytes: int


def layout(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[dict[str, object], list[Entry]]:
    """The safetensors header (a JSON-able dict) and the data entries in data order.

    Data is ordered by element size, largest first, so every tensor starts at an offset aligned
    to its element size and can be viewed in place.

    Raises:
        TypeError: a dtype safetensors cannot hold.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    order = list(tensors.items())
    if len({t.dtype for _, t in order}) > 1:
        order.sort(key=lambda kv: -kv[1].element_size())  # stable: keeps given order per size
    entries: list[Entry] = []
    offset = 0
    for key, tensor in order:
        name = _DTYPES.get(tensor.dtype)
        if name is None:
            raise TypeError(f"{key}: dtype {tensor.dtype} has no safetensors encoding")
        nbytes = tensor.numel() * _ITEMSIZE[tensor.dtype]
        header[key] = {"dtype": name, "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
        entries.append(Entry(key, tensor, offset, nbytes))
        offset += nbytes
    return header, entries


def prefix(header: Mapping[str, object]) -> bytes:
    """The file's first bytes: header length (8 bytes, little-endian) and the JSON header,
    padded with spaces to 8-byte alignment as safetensors does."""
    raw = json.dumps(header, separators=(",", ":")).encode()
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
        chunk_bytes (`int`, defaults to 256 MiB): largest device-side staging buffer; tensors
            are gathered per device into buffers of at most this size, each copied to the host
            in one transfer. ``0`` copies each tensor on its own (no extra GPU memory).

    Returns:
        `HostBuffer`: the file bytes and views of each tensor, valid once this returns.

    Raises:
        TypeError: a dtype safetensors cannot hold.
    """
    header, entries = layout(tensors, metadata)
    head = prefix(header)
    start = len(head)
    total = start + sum(e.nbytes for e in entries)
    on_cuda = any(e.tensor.is_cuda for e in entries)
    data = torch.empty(total, dtype=torch.uint8, pin_memory=on_cuda)

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
    out = _carve(section, [(e.key, e.tensor.dtype, tuple(e.tensor.shape), e.begin, e.nbytes) for e in entries])
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


def views(flat: torch.Tensor, header: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """Tensors described by a safetensors ``header`` inside the ``uint8`` data section ``flat``.

    Every entry is checked against ``flat``'s size before any view is made; entries not aligned
    to their element size are copied instead of viewed.

    Raises:
        ValueError: an unknown dtype, bad shape or offsets outside ``flat``.
    """
    size = flat.numel()
    items: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise ValueError(f"{key}: header entry must be an object")
        dtype = _FROM_NAME.get(info.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise ValueError(f"{key}: unsupported dtype {info.get('dtype')!r}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"{key}: bad shape {shape!r}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets):
            raise ValueError(f"{key}: bad data_offsets {offsets!r}")
        begin, end = offsets
        count = 1
        for d in shape:
            count *= d
        if begin < 0 or end != begin + count * _ITEMSIZE[dtype] or end > size:
            raise ValueError(f"{key}: data offsets {begin}..{end} do not fit shape {shape} in {size} bytes")
        items.append((key, dtype, tuple(shape), begin, end - begin))
    items.sort(key=lambda item: item[3])
    return _carve(flat, items)


# -- internals -----------------------------------------------------------------------------------


def _slot(section: torch.Tensor, entry: Entry) -> torch.Tensor:
    """``entry``'s bytes in ``section``, viewed as its dtype and shape."""
    raw = section[entry.begin : entry.begin + entry.nbytes]
    return raw.view(entry.tensor.dtype).view(entry.tensor.shape)


def _carve(section: torch.Tensor, items: list[tuple[str, torch.dtype, tuple[int, ...], int, int]]) -> dict[str, torch.Tensor]:
    """Views of ``(key, dtype, shape, begin, nbytes)`` items (sorted by ``begin``) in ``section``.

    Runs of adjacent same-dtype items are cut with one ``split`` (hundreds of small views cost
    milliseconds one by one); a misaligned item is copied.
    """
    out: dict[str, torch.Tensor] = {}
    i = 0
    while i < len(items):
        key, dtype, shape, begin, nbytes = items[i]
        size = _ITEMSIZE[dtype]
        if begin % size:
            out[key] = section[begin : begin + nbytes].clone().view(dtype).view(shape)
            i += 1
            continue
        j, end = i + 1, begin + nbytes
        while j < len(items) and items[j][1] == dtype and items[j][3] == end:
            end += items[j][4]
            j += 1
        parts = section[begin:end].view(dtype).split([items[k][4] // size for k in range(i, j)])
        for k, part in zip(range(i, j), parts):
            out[items[k][0]] = part.view(items[k][2])
        i = j
    return out


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
    """``run``'s tensors concatenated into a new flat tensor, flattened in C++ (not hundreds
    of Python-level reshapes)."""
    from torch._utils import _flatten_dense_tensors

    return _flatten_dense_tensors([e.tensor for e in run])


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
