"""Reading the safetensors layout out of any buffer: its length, header and bounds checked before
anything is copied, the tensors copied into memory the caller owns (the *read* verb of
:mod:`lorasync.wire`; the views it cuts are :mod:`lorasync.wire.views`').

* :func:`parse_header` checks a buffer's length and JSON header;
* :func:`read` copies every tensor out into memory of its own;
* :func:`read_section` copies the data section out once and cuts the tensors from it as views
  (a reader that copies them all again at once: an engine worker's build).

Ground floor: imports only the standard library, torch, numpy and lorasync's wire and error modules.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import torch

from lorasync.errors import WireFormatError
from lorasync.wire.dtypes import FROM_NAME
from lorasync.wire.views import BufferViews, ViewPlan, apply_views, plan_views, raw_bytes

__all__ = ["MAX_HEADER", "parse_header", "read", "read_section"]

MAX_HEADER = 100 * 1024 * 1024  # bytes of JSON header accepted from a peer


def parse_header(buf: Any, nbytes: int | None = None, *, what: str = "buffer") -> tuple[dict[str, Any], dict[str, str], int, int]:
    """The JSON header of a safetensors-layout buffer, checked for size and shape.

    Returns:
        ``(header, metadata, data_start, size)``: ``header`` without ``__metadata__``.

    Raises:
        WireFormatError: truncated, a bad header length, or a header that is not a JSON object
            with string metadata.
    """
    size = len(buf) if nbytes is None else min(nbytes, len(buf))
    if size < 8:
        raise WireFormatError(f"{what} is truncated ({size} bytes); the producer wrote less than a safetensors header")
    (hlen,) = struct.unpack("<Q", bytes(buf[:8]))
    if hlen > MAX_HEADER or 8 + hlen > size:
        raise WireFormatError(f"{what} has a bad header length {hlen}; it is truncated or not safetensors")
    try:
        header = json.loads(bytes(buf[8 : 8 + hlen]))
    except ValueError as exc:
        raise WireFormatError(f"{what} has a header that is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise WireFormatError(f"{what} has a header that is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise WireFormatError(f"{what} has a __metadata__ that is not a JSON object")
    return header, {str(k): str(v) for k, v in metadata.items()}, 8 + hlen, size


def _checked(buf: Any, nbytes: int | None, what: str) -> tuple[dict[str, Any], dict[str, str], int, ViewPlan]:
    """The header, metadata, data start and view plan of a buffer whose every bound was checked."""
    header, metadata, start, size = parse_header(buf, nbytes, what=what)
    try:
        view_plan = plan_views(header)
    except WireFormatError as exc:
        raise WireFormatError(f"{what}: {exc}") from exc
    if start + view_plan.end > size:
        raise WireFormatError(f"{what} is truncated: its header needs {view_plan.end} data bytes, {size - start} are there")
    return header, metadata, start, view_plan


def read(buf: Any, nbytes: int | None = None, *, what: str = "buffer") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Copy the tensors out of a safetensors-layout buffer (any object with the buffer protocol).

    Args:
        buf: e.g. a ``memoryview`` or a shared-memory ``buf``; only its first ``nbytes`` are read.
        nbytes (`int`, *optional*): valid length (default: the whole buffer).
        what (`str`): names the buffer in error messages.

    Returns:
        ``(tensors, metadata)``: CPU tensors, each in memory of its own, in header order.

    Raises:
        WireFormatError: a malformed or truncated buffer (bounds are checked before any copy).
    """
    header, metadata, start, view_plan = _checked(buf, nbytes, what)
    out: dict[str, torch.Tensor] = {}
    for key, info in header.items():
        dtype = FROM_NAME[info["dtype"]]
        begin, end = info["data_offsets"]
        data = torch.empty(info["shape"], dtype=dtype)
        if end > begin:
            # One memcpy per tensor through numpy (no per-tensor OpenMP hand-off); each tensor
            # owns its memory (torch.save refuses views of one buffer as different dtypes).
            raw_bytes(data)[:] = np.frombuffer(buf, dtype=np.uint8, count=end - begin, offset=start + begin)
        out[key] = data
    return out, metadata


def read_section(buf: Any, nbytes: int | None = None, *, what: str = "buffer") -> tuple[BufferViews, dict[str, str]]:
    """:func:`read`, with the whole data section copied out in one copy and the tensors cut from
    it as views (:class:`BufferViews`): for a reader that copies them all again at once (an
    engine worker's build: :meth:`BufferViews.copy_to`), instead of one copy per tensor.

    Raises:
        WireFormatError: a malformed or truncated buffer (bounds are checked before any copy).
    """
    header, metadata, start, view_plan = _checked(buf, nbytes, what)
    flat = torch.empty(view_plan.end, dtype=torch.uint8)
    if view_plan.end:
        flat.numpy()[:] = np.frombuffer(buf, dtype=np.uint8, count=view_plan.end, offset=start)
    return apply_views(flat, view_plan), metadata  # in data order
