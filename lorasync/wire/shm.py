"""Tensors in one POSIX shared-memory segment, laid out exactly as a safetensors file.

The producer copies the file bytes once into a segment; a consumer in another process (an
engine worker) attaches by name and copies the tensors out once (:func:`read_segment`), so
``safetensors.torch.load(bytes(segment))`` reads it too; no pickle is involved anywhere.

Every segment is made by :func:`create_segment`, which registers it with this process's resource
tracker (so it is unlinked if the producer dies). A consumer attaches without registering it
(:func:`attach`): Python < 3.13 registers attached segments too, and then either the consumer's
tracker unlinks the producer's segment when the consumer exits (a separate process tree, e.g. a
vLLM server), or — when the consumer shares the producer's tracker, as vLLM's workers spawned
by an in-process ``vllm.LLM`` do — an unregistering consumer took the producer's registration
away, and the producer's unlink made the tracker print a ``KeyError`` traceback per segment.

Fan-out: inside :func:`sharing` (the IPC transport opens one :class:`SegmentScope` per publish
for all its engines), :func:`write_segment` and ``wire.d2h.to_shm_segment`` make each distinct
(tensors, metadata) segment once and hand every later caller the same one; callers' ``release``
is then a no-op and the scope releases the segments when the last engine is done. A scope lives
for one publish only, so bytes are never reused across publishes (the tensors may be the
trainer's own, changed in place since).

Ground floor: imports only the standard library, torch and lorasync's wire and error modules.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import torch

from lorasync.errors import StorageError, WireFormatError
from lorasync.wire.layout import plan
from lorasync.wire.reading import read, read_section

__all__ = ["SegmentScope", "ShmSegment", "attach", "create_segment", "read_segment", "shared", "sharing", "write_segment"]

_TRACKING = threading.Lock()  # attach() switches registration off for a moment: not while a segment is made


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

    def __enter__(self) -> ShmSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Borrowed(ShmSegment):
    """A scope's segment as one caller sees it: releasing it is the scope's job."""

    def release(self) -> None:
        """No-op: the :class:`SegmentScope` releases the segment."""


class SegmentScope:
    """The segments of one publish, shared by every engine on this host (see module docstring).

    Thread-safe: the first caller of a key makes the segment while later ones wait, then reuse it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._segments: dict[object, ShmSegment] = {}
        self.made = 0  # segments made (for tests and benchmarks)
        self.shared = 0  # calls answered with an existing segment

    def get(self, key: object, make: Callable[[], ShmSegment]) -> ShmSegment:
        """The segment for ``key``, made with ``make`` on first use."""
        with self._lock:
            seg = self._segments.get(key)
            if seg is None:
                seg = self._segments[key] = make()
                self.made += 1
            else:
                self.shared += 1
        return _Borrowed(name=seg.name, nbytes=seg.nbytes, _shm=seg._shm)

    def close(self) -> None:
        """Release every segment (idempotent)."""
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
        for seg in segments:
            seg.release()


_SCOPE: contextvars.ContextVar[SegmentScope | None] = contextvars.ContextVar("lorasync_segment_scope", default=None)


@contextlib.contextmanager
def sharing(scope: SegmentScope) -> Iterator[SegmentScope]:
    """Segments made in this context (this task, threads it starts with ``asyncio.to_thread``)
    come from ``scope``."""
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def shared(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None, make: Callable[[], ShmSegment]) -> ShmSegment:
    """``make()``, or the active scope's segment for these tensors and metadata."""
    scope = _SCOPE.get()
    if scope is None:
        return make()
    # The mapping's identity: one Adapter's tensors within one publish (the scope's lifetime).
    key = (id(tensors), tuple(sorted((metadata or {}).items())))
    return scope.get(key, make)


def create_segment(nbytes: int, fill: Callable[[torch.Tensor], None]) -> ShmSegment:
    """A new segment of ``nbytes``, filled by ``fill`` (given the segment as a ``uint8`` tensor)
    and recorded for clean-up; on any failure the segment is unlinked again.

    Raises:
        StorageError: the segment cannot be created (``/dev/shm`` full or not writable).
    """
    try:
        with _TRACKING:
            shm = shared_memory.SharedMemory(create=True, size=max(1, nbytes))
    except OSError as exc:
        raise StorageError(f"cannot create a shared-memory segment of {nbytes} bytes: {exc}; free space in /dev/shm or use transport='disk'") from exc
    try:
        if nbytes:
            view = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
            try:
                fill(view)
            finally:
                del view  # a live view of the buffer would keep the segment from closing
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    return ShmSegment(name=shm.name, nbytes=nbytes, _shm=shm)


def write_segment(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> ShmSegment:
    """Copy ``tensors`` into a new shared-memory segment in safetensors layout (the caller's
    order); each tensor is copied once. Inside :func:`sharing`, the scope's segment for them.

    Raises:
        UnsupportedDtypeError: a dtype safetensors cannot hold.
        StorageError: the segment cannot be created.
    """

    def make() -> ShmSegment:
        layout = plan(tensors, metadata if metadata is not None else {}, grouped=False)
        values = list(tensors.values())
        return create_segment(layout.total, lambda view: layout.write_into(view, values))

    return shared(tensors, metadata, make)


def attach(name: str) -> shared_memory.SharedMemory:
    """Attach to segment ``name`` without registering it with this process's resource tracker
    (it is the producer's; see the module docstring).

    Raises:
        FileNotFoundError, ValueError: no such segment.
    """
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, create=False, track=False)
    with _TRACKING:
        register = resource_tracker.register
        resource_tracker.register = lambda *args, **kwargs: None  # what track=False does on 3.13
        try:
            return shared_memory.SharedMemory(name=name, create=False)
        finally:
            resource_tracker.register = register


def read_segment(name: str, nbytes: int | None = None, *, one_buffer: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Attach to segment ``name`` and copy its tensors out (the producer may then unlink it).

    Args:
        one_buffer: copy the data section out whole and return the tensors as views of that one
            copy (:func:`~lorasync.wire.reading.read_section`), instead of one copy per tensor.

    Returns:
        ``(tensors, metadata)``.

    Raises:
        WireFormatError: a malformed or truncated segment (bounds are checked before any copy).
        StorageError: no segment of that name exists (the producer released it or died).
    """
    try:
        shm = attach(name)
    except (FileNotFoundError, ValueError) as exc:
        raise StorageError(f"shared-memory segment {name} does not exist: {exc}; the producer released it or died, publish again") from exc
    try:
        return (read_section if one_buffer else read)(shm.buf, nbytes, what=f"shared-memory segment {name}")
    finally:
        shm.close()


_ = WireFormatError  # re-raised from read(); named in the docstring above
