"""Transports: how an Adapter's bytes reach an engine.

``disk`` (atomic versioned directories, tmpfs by default), ``ipc`` (shared memory / CUDA IPC,
no files) and ``merged`` (W0 + s·B·A folded from the pristine base, streamed in buckets).

May import: errors, wire, runtime, adapter, ``lorasync.transforms`` and the engine protocol
(``lorasync.engines._engine``); never an engine client or anything above them.
"""

from lorasync.transports._transport import Delivery, Transport
from lorasync.transports._base_weights import BaseWeights
from lorasync.transports._store import DiskStore, default_root
from lorasync.transports.disk import DiskTransport
from lorasync.transports.ipc import IPCTransport
from lorasync.transports.merged import MergedTransport

__all__ = ["BaseWeights", "Delivery", "DiskStore", "DiskTransport", "IPCTransport", "MergedTransport", "Transport", "default_root"]
