"""The wire formats: how adapter tensors are laid out as bytes, wherever the bytes go.

Ground floor of the package: modules here import only the standard library, torch, numpy and
:mod:`lorasync.errors`, never anything above them (transports, engines, the Adapter), and they
run inside engine processes too.

* :mod:`~lorasync.wire.dtypes` — the one torch dtype ↔ safetensors name table.
* :mod:`~lorasync.wire.layout` — the safetensors layout: plan and write.
* :mod:`~lorasync.wire.views` — the same layout viewed in place: bounds-checked views and their copies.
* :mod:`~lorasync.wire.reading` — the same layout read back out of any buffer.
* :mod:`~lorasync.wire.shm` — POSIX shared-memory segments holding such a layout.
* :mod:`~lorasync.wire.d2h` — GPU tensors to one pinned host buffer in that layout.
* :mod:`~lorasync.wire.cuda_ipc` — the layout in one shared GPU buffer for a colocated process.

Codec failures raise :class:`lorasync.errors.WireFormatError` (bad bytes or specs),
:class:`~lorasync.errors.UnsupportedDtypeError` and
:class:`~lorasync.errors.CudaIpcUnavailableError`.

May import: :mod:`lorasync.errors` only.
"""
