"""Host adapters read in place: each tensor's hash header and its memory as a buffer, and the
safetensors file written (and hashed) from those buffers in one pass.

Own code, for speed (``lorasync bench publish``; docs/benchmarks.md, issue 34). Writing an 87 MB,
504-tensor adapter to tmpfs costs ~30 ms of kernel copies; the library and generic paths spent
~9 ms more in Python per tensor (``safetensors.save_file`` stages the whole file; the former
writer made a numpy view per tensor through three torch calls, a ``BufferedWriter`` call, and
formatted the hash header anew). Here, for plain, contiguous CPU tensors:

* each tensor's memory is handed to ``xxhash`` and to ``os.write`` as a ``ctypes`` array over
  ``data_ptr()`` (one object, no torch call), read in place;
* the hash header of each ``(key, dtype, shape)`` is formatted once and kept (a trainer writes
  the same few hundred every step);
* the file is written through its descriptor, with no buffer in between.

The bytes and the hash are exactly those of :meth:`Adapter.save_hashed`'s general path (the
safetensors layout of :func:`lorasync.wire.layout.plan`, in the adapter's order; the stream of
:attr:`Adapter.content_hash`); ``tests/test_adapter_memory.py`` holds them equal. Tensors
elsewhere (GPU, strided, subclasses, no data) are not handled here: :func:`host_views` returns
None and the caller takes the general path.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["host_views", "tensor_header", "write_views"]

# Subclasses may not keep their data at data_ptr(); these two do.
_PLAIN = (torch.Tensor, torch.nn.Parameter)
# The stream's per-tensor header by (key, dtype, shape): the same few hundred every step.
_HEADERS: dict[tuple[str, torch.dtype, torch.Size], bytes] = {}
_EMPTY = b""


def tensor_header(key: str, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> bytes:
    """What the content hash's stream holds before each tensor's bytes (the one definition)."""
    return f"\0{key}\0{dtype}\0{tuple(shape)}\0".encode()


def host_views(tensors: Mapping[str, torch.Tensor]) -> list[tuple[bytes, Any]] | None:
    """Per tensor, in order: its hash header and a buffer over its memory (``b""`` when empty).

    The buffers read the tensors' memory in place and are valid while the tensors live (the
    caller holds them). None when any tensor is not a plain, contiguous CPU tensor.
    """
    out: list[tuple[bytes, Any]] = []
    for key, tensor in tensors.items():
        if type(tensor) not in _PLAIN or tensor.layout is not torch.strided or not tensor.is_cpu or tensor.is_meta or not tensor.is_contiguous():
            return None
        if tensor.is_neg() or tensor.is_conj():  # lazy negation/conjugation: memory holds other values
            return None
        if tensor._is_zerotensor() or (tensor.numel() and not tensor.data_ptr()):  # lazy zeros: no memory at all
            return None
        if tensor.untyped_storage().nbytes() < (tensor.storage_offset() + tensor.numel()) * tensor.element_size():
            # Storage the trainer freed (FSDP resizes it to 0): no address to read in place; the
            # general path (and the publisher's refuse_freed) says what is wrong.
            return None
        meta = (key, tensor.dtype, tensor.shape)
        header = _HEADERS.get(meta)
        if header is None:
            if len(_HEADERS) > 65536:
                _HEADERS.clear()
            header = _HEADERS[meta] = tensor_header(key, tensor.dtype, tensor.shape)
        size = tensor.nbytes
        out.append((header, (ctypes.c_char * size).from_address(tensor.data_ptr()) if size else _EMPTY))
    return out


def write_views(fd: int, prefix: bytes, views: list[tuple[bytes, Any]], h: Any) -> int:
    """Write ``prefix`` then every view's buffer to ``fd``; with ``h``, feed it each header and
    buffer right before that buffer is written. Returns the bytes written.

    Raises:
        OSError: the write failed (the caller removes the file).
    """
    written = _write_all(fd, prefix)
    for header, buf in views:
        if h is not None:
            h.update(header)
            h.update(buf)
        if len(buf):
            written += _write_all(fd, buf)
    return written


def _write_all(fd: int, buf: Any) -> int:
    """``os.write`` until every byte of ``buf`` is written (a regular file may take less at once)."""
    n = os.write(fd, buf)
    total = len(buf)  # bytes, or a ctypes char array: its length is its size in bytes
    if n < total:
        view = memoryview(buf).cast("B")
        while n < total:
            n += os.write(fd, view[n:])
    return n
