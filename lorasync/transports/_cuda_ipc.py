"""Old import path of :mod:`lorasync.wire.cuda_ipc`, kept only so branches written against it
keep importing until they are merged; new code imports ``lorasync.wire.cuda_ipc``."""

from __future__ import annotations

from lorasync.wire.cuda_ipc import (
    SPEC_VERSION,
    CudaExport,
    CudaIpcUnavailable,
    CudaIpcUnavailableError,
    export_tensors,
    import_tensors,
    parse_spec,
)

__all__ = ["SPEC_VERSION", "CudaExport", "CudaIpcUnavailable", "CudaIpcUnavailableError", "export_tensors", "import_tensors", "parse_spec"]
