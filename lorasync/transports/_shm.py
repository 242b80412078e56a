"""Tensors in one POSIX shared-memory segment, laid out exactly as a safetensors file.

The producer writes the header and copies each tensor once into the segment; a consumer in
another process (an engine worker) attaches by name and copies the tensors out once. The layout
is the safetensors format (8-byte little-endian header length, JSON header, raw data), so
``safetensors.torch.load(bytes(segment))`` reads it too; no pickle is involved anywhere.
:func:`plan_layout` / :func:`parse_layout` are the layout itself, independent of shared memory:
``lorasync.distributed`` writes the same bytes into a ``uint8`` tensor it sends over
torch.distributed.

This module imports only the standard library and torch: it also runs inside engine processes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

__all__ = ["Layout", "ShmSegment", "parse_layout", "plan_layout", "read_segment", "write_segment"]

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024
_OWNED: set[str] = set()  # segments created by this process


@dataclass
class ShmSegment:
    """A producer-owned segment. Keep it alive until the consumer confirms, then ``release()``."""

    name: str
    nbytes: int
    _shm: shared_memory.SharedMemory

    def release(self) -> None:
        """Close and unlink (idempotent)."""
        try:
            self._shm.close()
            self._shm.unlink()
        except FileNotFoundError:
            pass
        _OWNED.discard(self.name)

    def __enter__(self) -> ShmSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True)
class Layout:
    """Where every tensor goes in a safetensors-layout buffer (computed once, written anywhere).

    Attributes:
        header (`bytes`): the 8-byte little-endian length followed by the padded JSON header.
        entries: ``(absolute offset, tensor)`` for each tensor, in header order.
        nbytes (`int`): total buffer size: header plus every tensor's bytes.
    """

    header: bytes
    entries: tuple[tuple[int, torch.Tensor], ...]
    nbytes: int

    def write_into(self, out: torch.Tensor) -> None:
        """Copy header and tensors into ``out``, a 1-D ``uint8`` tensor of at least ``nbytes``
        elements on any device (each source tensor is copied once, device to device)."""
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < self.nbytes:
            raise ValueError(f"need a 1-D uint8 tensor of at least {self.nbytes} elements, got {out.dtype} {tuple(out.shape)}")
        head = torch.frombuffer(bytearray(self.header), dtype=torch.uint8)
        out[: len(self.header)].copy_(head)
        # CPU to CPU: a plain memcpy through numpy; torch's copy_ hands every tensor to an
        # OpenMP pool, which costs more than the copy for adapter-sized tensors (measured 6x).
        host = out.numpy() if out.device.type == "cpu" else None
        for begin, tensor in self.entries:
            n = tensor.numel() * tensor.element_size()
            if not n:
                continue
            src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            if host is not None and src.device.type == "cpu":
                host[begin : begin + n] = src.numpy()
            else:
                out[begin : begin + n].copy_(src)


def plan_layout(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> Layout:
    """Lay ``tensors`` out as a safetensors file (header, then raw data in the given order).

    Raises:
        TypeError: a dtype safetensors cannot name.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    offset = 0
    flat: list[tuple[int, torch.Tensor]] = []
    for key, tensor in tensors.items():
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"{key}: dtype {tensor.dtype} cannot be shared")
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
        flat.append((offset, tensor))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment
    start = 8 + len(raw)
    return Layout(struct.pack("<Q", len(raw)) + raw, tuple((start + b, t) for b, t in flat), start + offset)


def write_segment(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> ShmSegment:
    """Copy ``tensors`` (CPU) into a new shared-memory segment in safetensors layout."""
    layout = plan_layout(tensors, metadata)
    shm = shared_memory.SharedMemory(create=True, size=max(1, layout.nbytes))
    try:
        view = torch.frombuffer(shm.buf, dtype=torch.uint8, count=layout.nbytes)
        try:
            layout.write_into(view)
        finally:
            del view  # an exported buffer would keep the segment from closing
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    _OWNED.add(shm.name)
    return ShmSegment(name=shm.name, nbytes=layout.nbytes, _shm=shm)


def read_segment(name: str, nbytes: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Attach to segment ``name`` and copy its tensors out (the producer may then unlink it).

    Returns:
        ``(tensors, metadata)``.

    Raises:
        ValueError: a malformed or truncated segment (bounds are checked before any copy).
    """
    shm = shared_memory.SharedMemory(name=name, create=False)
    # Python < 3.13 registers attached segments with the resource tracker, which would unlink
    # the producer's segment when this process exits; only the producer owns it. (In the
    # producer's own process the registration is the producer's and stays.)
    if name not in _OWNED:
        try:
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        except Exception:
            pass
    try:
        return parse_layout(shm.buf, nbytes, what=f"shared-memory segment {name}")
    finally:
        shm.close()


def parse_layout(buf: Any, nbytes: int | None = None, *, what: str = "buffer") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Copy the tensors out of a safetensors-layout buffer (any object with the buffer protocol).

    Args:
        buf: e.g. a ``memoryview`` or a shared-memory ``buf``; only its first ``nbytes`` are read.
        nbytes (`int`, *optional*): valid length (default: the whole buffer).
        what (`str`): names the buffer in error messages.

    Returns:
        ``(tensors, metadata)``: CPU tensors that own their memory.

    Raises:
        ValueError: a malformed or truncated buffer (bounds are checked before any copy).
    """
    size = len(buf) if nbytes is None else min(nbytes, len(buf))
    if size < 8:
        raise ValueError(f"{what} is truncated")
    (hlen,) = struct.unpack("<Q", bytes(buf[:8]))
    if hlen > _MAX_HEADER or 8 + hlen > size:
        raise ValueError(f"{what} has a bad header length {hlen}")
    header = json.loads(bytes(buf[8 : 8 + hlen]))
    if not isinstance(header, dict):
        raise ValueError(f"{what} has a header that is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    start = 8 + hlen
    out: dict[str, torch.Tensor] = {}
    for key, info in header.items():
        dtype = _FROM_NAME.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{key}: unsupported dtype {info['dtype']!r}")
        begin, end = (int(x) for x in info["data_offsets"])
        shape = [int(d) for d in info["shape"]]
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = 1
        for d in shape:
            count *= d
        if begin < 0 or end != begin + count * itemsize or start + end > size:
            raise ValueError(f"{key}: data offsets {begin}..{end} do not fit shape {shape} in the {what}")
        if count == 0:
            out[key] = torch.empty(shape, dtype=dtype)
            continue
        # One memcpy out of the buffer (numpy: no per-tensor OpenMP hand-off), then views.
        data = torch.empty(end - begin, dtype=torch.uint8)
        data.numpy()[:] = np.frombuffer(buf, dtype=np.uint8, count=end - begin, offset=start + begin)
        out[key] = data.view(dtype).reshape(shape)
    return out, {str(k): str(v) for k, v in metadata.items()}
