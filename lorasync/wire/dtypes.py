"""The one table between torch dtypes and safetensors dtype names (and their sizes).

Every wire format of lorasync (files, shared-memory segments, CUDA IPC specs, the
torch.distributed buffer) names dtypes through this table; nothing else keeps its own.
"""

from __future__ import annotations

import torch

from lorasync.errors import UnsupportedDtypeError

__all__ = ["FROM_NAME", "ITEMSIZE", "NAMES", "dtype_of", "name_of", "size_of_name"]

#: torch dtype -> safetensors name, for every dtype lorasync puts on the wire.
NAMES: dict[torch.dtype, str] = {
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
#: safetensors name -> torch dtype.
FROM_NAME: dict[str, torch.dtype] = {v: k for k, v in NAMES.items()}
#: torch dtype -> bytes per element.
ITEMSIZE: dict[torch.dtype, int] = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in NAMES}
# Names safetensors knows that lorasync does not move (it still sizes them for inspection).
_OTHER_SIZES = {"F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def name_of(dtype: torch.dtype, *, key: str = "") -> str:
    """The safetensors name of ``dtype``.

    Raises:
        UnsupportedDtypeError: a dtype the wire formats cannot hold.
    """
    try:
        return NAMES[dtype]
    except KeyError:
        where = f"{key}: " if key else ""
        raise UnsupportedDtypeError(
            f"{where}dtype {dtype} has no safetensors encoding lorasync moves; cast it to float32, bfloat16 or float16",
            key=key or None,
        ) from None


def dtype_of(name: object, *, key: str = "") -> torch.dtype:
    """The torch dtype of safetensors name ``name``.

    Raises:
        UnsupportedDtypeError: an unknown or unsupported name.
    """
    dtype = FROM_NAME.get(name) if isinstance(name, str) else None
    if dtype is None:
        where = f"{key}: " if key else ""
        raise UnsupportedDtypeError(f"{where}unsupported dtype {name!r}; lorasync reads {sorted(FROM_NAME)}", key=key or None)
    return dtype


def size_of_name(name: str) -> int:
    """Bytes per element of safetensors dtype ``name`` (case-insensitive).

    Raises:
        UnsupportedDtypeError: a name safetensors does not define.
    """
    upper = name.upper()
    if upper in FROM_NAME:
        return ITEMSIZE[FROM_NAME[upper]]
    if upper in _OTHER_SIZES:
        return _OTHER_SIZES[upper]
    raise UnsupportedDtypeError(f"unknown safetensors dtype {name!r}; the file was not written by safetensors")
