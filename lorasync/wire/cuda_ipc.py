"""CUDA IPC handoff: a colocated process maps the trainer's GPU memory and copies the adapter
out of it, with no trip through the trainer's host memory.

Producer (the trainer, :func:`share_tensors`): the adapter's tensors are packed into one flat
device buffer laid out like a safetensors data section (one gather kernel per group of
:mod:`lorasync.wire.layout`'s grouped layout: three for an adapter; it also snapshots them, so the
optimizer may move on), and that buffer is shared once with
``torch.multiprocessing.reductions.reduce_tensor``. The handle tuple is encoded field by field
as JSON (bytes as base64) next to the safetensors header: no pickle crosses the boundary.

Consumer (an engine worker, :func:`import_tensors`): validates the spec, maps the buffer, makes
its stream wait for the producer's pack through the shared CUDA event, queues the copy into its
own memory (its GPU, or page-locked host memory), cuts the views (one ``split`` per group) while
the copy runs, and waits. Returning is the confirmation.

Mapping cache (written by hand for speed: opening and closing the mapping was ~0.5 ms of a
~3 ms handoff). The producer's buffer comes from its caching allocator, so step after step it
lies in the same cudaMalloc segment, which the driver names by the same handle. The consumer
keeps the mapping of the last few segments (:data:`MAX_MAPPINGS`, keyed by device and handle
bytes) and maps a segment again only for a handle it has not kept. This is safe against the
producer's allocator because a handle names one allocation: a segment the producer frees and
allocates anew gets a new handle (``tests/gpu/test_cuda_ipc_gpu.py`` checks it on the device),
so a new allocation is never read through a stale mapping; within a kept segment every step
passes its own offset, and the copy waits for that step's event, never for an earlier one.
A kept mapping holds the producer's freed segment alive in the driver until it is evicted or
:func:`close_mappings` drops it.

Lifetime: the producer keeps the buffer until every consumer has returned, then calls
:meth:`CudaShare.release`. torch's own cross-process reference count expects exactly one
consumer per share; a collective RPC reaches any number of workers with one spec, so consumers
get no counter and the producer gives back its share's count itself once all have confirmed.

Ground floor: imports only the standard library, torch and lorasync's wire and error modules;
it runs inside engine processes too.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from lorasync.errors import CudaIpcUnavailableError, WireFormatError
from lorasync.wire.d2h import gather_into
from lorasync.wire.layout import plan
from lorasync.wire.views import ViewPlan, apply_views, plan_views

__all__ = ["MAX_MAPPINGS", "SPEC_VERSION", "CudaShare", "CudaIpcUnavailableError", "close_mappings", "share_tensors", "import_tensors", "parse_spec"]

SPEC_VERSION = 1
_MAX_HANDLE = 4096  # bytes; a cudaIpcMemHandle is 64, expandable-segment handles are a little larger
# Field order of torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments.
_FIELDS = (
    "tensor_cls",
    "size",
    "stride",
    "tensor_offset",
    "storage_cls",
    "dtype",
    "device",
    "handle",
    "storage_size",
    "storage_offset",
    "requires_grad",
    "ref_counter",
    "ref_counter_offset",
    "event",
    "event_sync",
)


#: Producer segments a consumer keeps mapped (module docstring, "Mapping cache").
MAX_MAPPINGS = 4
# (device, handle) -> (bytes of the segment the storage covers from offset 0, storage)
_mappings: OrderedDict[tuple[int, bytes], tuple[int, torch.UntypedStorage]] = OrderedDict()
_mappings_lock = threading.Lock()



class CudaShare:
    """A shared flat GPU buffer and its JSON-able :attr:`spec`; release after every consumer
    has confirmed (context manager: released on exit)."""

    def __init__(self, spec: dict[str, Any], flat: torch.Tensor, ref_counter: bytes, ref_counter_offset: int) -> None:
        self.spec = spec
        self._flat: torch.Tensor | None = flat
        self._ref = (ref_counter, ref_counter_offset)

    @property
    def nbytes(self) -> int:
        return int(self.spec["nbytes"])

    def release(self) -> None:
        """Give back the share and free the buffer (idempotent).

        Call only once every consumer has copied the data out (returned from
        :func:`import_tensors`): the memory is reused right away.
        """
        if self._flat is None:
            return
        handle, offset = self._ref
        if handle:
            # The one count torch set for this share; consumers were given none (module docstring).
            torch.UntypedStorage._release_ipc_counter_cuda(handle, offset)
        self._flat = None
        torch.cuda.ipc_collect()

    def __enter__(self) -> CudaShare:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def share_tensors(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> CudaShare:
    """Pack ``tensors`` (all on one CUDA device) into one buffer and share it.

    Args:
        tensors (`Mapping[str, torch.Tensor]`): the tensors; work queued on the device's current
            stream before the call is waited for by consumers (shared CUDA event).
        metadata (`Mapping[str, str]`, *optional*): carried in the header's ``__metadata__``.

    Returns:
        `CudaShare`: ``spec`` for :func:`import_tensors`; keep it until consumers confirm.

    Raises:
        WireFormatError: a tensor is not on CUDA, or they span several devices.
        UnsupportedDtypeError: a dtype safetensors cannot hold.
    """
    indices = set(map(torch.Tensor.get_device, tensors.values()))  # ints (-1: host): no device objects
    if len(indices) != 1 or min(indices) < 0:
        devices = {t.device for t in tensors.values()}
        raise WireFormatError(f"CUDA IPC needs every tensor on one CUDA device; got {sorted(map(str, devices))}")
    device = torch.device("cuda", next(iter(indices)))
    layout = plan(tensors, metadata)  # cached per structure: every step sends the same one
    header, nbytes = layout.header, layout.nbytes
    # One buffer laid out like the safetensors data section, each group of tensors gathered into
    # it with one kernel (which also snapshots them, so the optimizer may move on).
    flat = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)  # never empty: a storage to share
    gather_into(flat[:nbytes], layout, list(tensors.values()), chunk_bytes=nbytes)
    # The work above runs on the current stream; the event reduce_tensor records there follows it.
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    rebuild, args = reduce_tensor(flat)
    if rebuild is not rebuild_cuda_tensor or len(args) != len(_FIELDS):
        raise CudaIpcUnavailableError(f"torch {torch.__version__} shares CUDA tensors in an unknown format; lorasync falls back to shared memory")
    fields = dict(zip(_FIELDS, args))
    spec = {
        "version": SPEC_VERSION,
        "nbytes": nbytes,
        "header": header,
        "ipc": {
            "device": int(fields["device"]),
            "device_uuid": _uuid(device.index if device.index is not None else torch.cuda.current_device()),
            "handle": _b64(fields["handle"]),
            "storage_size": int(fields["storage_size"]),
            "storage_offset": int(fields["storage_offset"]),
            "event": _b64(fields["event"] or b""),
            "event_sync": bool(fields["event_sync"]),
        },
    }
    return CudaShare(spec, flat, bytes(fields["ref_counter"] or b""), int(fields["ref_counter_offset"]))


def parse_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a spec from :func:`share_tensors` (types, sizes, base64) without touching CUDA.

    Returns:
        The decoded IPC fields plus ``nbytes``, ``plan`` (validated views) and ``metadata``.

    Raises:
        WireFormatError: naming the first bad field.
    """
    if not isinstance(spec, Mapping) or spec.get("version") != SPEC_VERSION:
        raise WireFormatError(f"CUDA IPC spec must be an object with version {SPEC_VERSION}")
    nbytes, text, ipc = spec.get("nbytes"), spec.get("header"), spec.get("ipc")
    if not _is_int(nbytes) or nbytes < 0:
        raise WireFormatError(f"CUDA IPC spec: bad nbytes {nbytes!r}")
    if not isinstance(text, str) or not isinstance(ipc, dict):
        raise WireFormatError("CUDA IPC spec needs a 'header' (safetensors JSON text) and an 'ipc' object")
    view_plan, metadata = _header_plan(text)
    if view_plan.end > nbytes:
        raise WireFormatError(f"CUDA IPC spec: the header needs {view_plan.end} bytes, the buffer has {nbytes}")
    out: dict[str, Any] = {"nbytes": nbytes, "plan": view_plan, "metadata": metadata}
    for name in ("device", "storage_size", "storage_offset"):
        value = ipc.get(name)
        if not _is_int(value) or value < 0:
            raise WireFormatError(f"CUDA IPC spec: bad {name} {value!r}")
        out[name] = value
    if not isinstance(ipc.get("event_sync"), bool) or not isinstance(ipc.get("device_uuid"), str):
        raise WireFormatError("CUDA IPC spec: bad event_sync or device_uuid")
    out["event_sync"], out["device_uuid"] = ipc["event_sync"], ipc["device_uuid"]
    for name in ("handle", "event"):
        out[name] = _unb64(ipc.get(name), name)
    if not out["handle"] and nbytes:
        raise WireFormatError("CUDA IPC spec: empty memory handle")
    if nbytes > out["storage_size"]:
        raise WireFormatError(f"CUDA IPC spec: {nbytes} bytes do not fit the shared storage of {out['storage_size']}")
    return out


def import_tensors(
    spec: Mapping[str, Any], *, device: torch.device | str | int | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Map the producer's buffer, copy it into this process's memory and return its tensors.

    Args:
        spec (`Mapping`): :attr:`CudaShare.spec`, e.g. after a JSON round trip.
        device (*optional*): where the copy goes; defaults to the producer's GPU as this process
            numbers it. ``"cpu"`` copies straight from the producer's memory into page-locked
            host memory (one transfer, no copy on this process's GPU).

    Returns:
        ``(tensors, metadata)``: views into one buffer this process owns; the producer's memory
        is no longer referenced, so it may be released once this returns.

    Raises:
        WireFormatError: a malformed spec.
        CudaIpcUnavailableError: no CUDA here, the producer's GPU is not visible, or the driver
            refused the handle.
    """
    fields = parse_spec(spec)
    nbytes = fields["nbytes"]
    if not torch.cuda.is_available():
        raise CudaIpcUnavailableError("this process has no CUDA device")
    local = _local_index(fields["device_uuid"])
    target = torch.device("cuda", local) if device is None else torch.device(device)
    if target.type == "cpu":
        own = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    else:
        own = torch.empty(nbytes, dtype=torch.uint8, device=target)
    if not nbytes:
        return apply_views(own, fields["plan"]), dict(fields["metadata"])
    try:
        with torch.cuda.device(local):
            shared = _map(local, fields)
            # The current stream of ``local`` now waits for the producer's event; the copy runs there.
            own.copy_(shared, non_blocking=True)
            out = apply_views(own, fields["plan"])  # host work while the copy runs
            torch.cuda.current_stream(local).synchronize()
    except RuntimeError as exc:
        raise CudaIpcUnavailableError(f"cannot map the producer's GPU memory: {exc}") from exc
    if own.is_cuda and own.device.index != local:
        torch.cuda.current_stream(own.device).synchronize()
    return out, dict(fields["metadata"])


def close_mappings() -> int:
    """Unmap every producer segment this process keeps mapped; how many there were.

    Safe at any time: the next :func:`import_tensors` maps again.
    """
    with _mappings_lock:
        count = len(_mappings)
        _mappings.clear()
    return count


# -- internals -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _header_plan(text: str) -> tuple[ViewPlan, dict[str, str]]:
    """Parse and validate a header once per distinct text (every step sends the same one)."""
    try:
        header = json.loads(text)
    except ValueError as exc:
        raise WireFormatError(f"CUDA IPC spec: header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise WireFormatError("CUDA IPC spec: header must be a JSON object")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise WireFormatError("CUDA IPC spec: __metadata__ must map strings to strings")
    return plan_views(header), metadata


def _map(local: int, fields: Mapping[str, Any]) -> torch.Tensor:
    """The producer's ``nbytes`` at its offset as a ``uint8`` tensor, through a kept mapping of
    its segment when there is one; the current stream of ``local`` waits for its event."""
    nbytes, offset, handle = fields["nbytes"], fields["storage_offset"], fields["handle"]
    key = (local, handle)
    with _mappings_lock:
        kept = _mappings.get(key)
        if kept is not None and offset + nbytes <= kept[0]:
            _mappings.move_to_end(key)
            storage = kept[1]
            if fields["event_sync"] and fields["event"]:
                event = torch.cuda.Event.from_ipc_handle(local, fields["event"])
                torch.cuda.current_stream(local).wait_event(event)
        else:
            # One storage from the start of the segment to the end of this buffer: later buffers
            # at lower offsets of the same segment reuse it. torch opens the handle (or finds the
            # mapping a kept storage holds open) and makes the current stream wait for the event.
            covered = offset + fields["storage_size"]
            storage = torch.UntypedStorage._new_shared_cuda(local, handle, covered, 0, b"", 0, fields["event"], fields["event_sync"])
            _mappings[key] = (covered, storage)
            _mappings.move_to_end(key)
            while len(_mappings) > MAX_MAPPINGS:
                _mappings.popitem(last=False)
    flat = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", local))
    return flat.set_(storage, offset, (nbytes,), (1,))


@functools.lru_cache(maxsize=64)
def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _local_index(device_uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if _uuid(index) == device_uuid:
            return index
    raise CudaIpcUnavailableError(f"the producer's GPU {device_uuid} is not visible to this process (CUDA_VISIBLE_DEVICES)")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _b64(raw: bytes) -> str:
    return base64.b64encode(bytes(raw)).decode("ascii")


def _unb64(value: object, name: str) -> bytes:
    if not isinstance(value, str) or len(value) > 2 * _MAX_HANDLE:
        raise WireFormatError(f"CUDA IPC spec: bad {name}")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireFormatError(f"CUDA IPC spec: {name} is not base64") from exc
