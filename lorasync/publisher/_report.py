"""PublishReport: what one publish did, per engine, with timings and typed errors.

Both are plain dataclasses of plain values (``dataclasses.asdict``, ``copy.deepcopy`` and pickle
work on every report); the handle on a background retirement still running is an attribute
outside the fields, which none of those copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from lorasync.errors import LoraSyncError, PublishError

if TYPE_CHECKING:
    from lorasync.runtime._loop import Pending

__all__ = ["EngineResult", "PublishReport"]


@dataclass
class EngineResult:
    """Outcome for one engine.

    ``status`` is ``"loaded"`` (now serving the new version), ``"unchanged"`` (it already served
    identical content; nothing moved) or ``"failed"`` (see ``error``; the engine keeps serving
    its previous version).
    """

    engine: str
    url: str
    status: str
    transport: str | None = None
    reason: str = ""
    served_name: str | None = None
    bytes_moved: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    retired: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)  # outside the window, kept loaded: requests still use them
    error: LoraSyncError | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("loaded", "unchanged")

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "url": self.url,
            "status": self.status,
            "ok": self.ok,
            "transport": self.transport,
            "reason": self.reason,
            "served_name": self.served_name,
            "bytes_moved": self.bytes_moved,
            "timings": dict(self.timings),
            "retired": list(self.retired),
            "deferred": list(self.deferred),
            "error": None if self.error is None else {"type": type(self.error).__name__, "message": str(self.error)},
        }


@dataclass
class PublishReport:
    """Result of ``publish_adapter`` / ``Publisher.publish``.

    ``served_name`` is what to put in requests (``model=`` for vLLM) on engines that load
    adapters; merged engines serve the new weights under their base model name.
    """

    name: str
    version: int
    served_name: str
    content_hash: str
    nbytes: int
    results: list[EngineResult] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    # The retirement this publish left running (``Retention.background``); set on the instance,
    # never a field: no copy of the report (asdict, deepcopy, pickle) takes it along.
    _after: ClassVar[Pending | None] = None

    def settled(self, timeout: float | None = None) -> PublishReport:
        """Wait until this publish's retirement of old versions (and collection of their files)
        finished; then ``retired``, ``deferred`` and ``timings`` are final. Returns ``self``.

        The next publish, ``Publisher.collect`` and ``close`` wait for it anyway; call this only
        to look at the engine's state right after a publish.

        A retirement stuck in an engine call is cancelled once the next publish (or ``collect``,
        ``close``) has waited out its bound; it then says so in ``reason`` and lists what it left
        loaded in ``deferred``.

        Raises:
            BlockingCallError: called on an event loop the publisher's work needs (use
                :meth:`asettled`). It is a ``RuntimeError`` too.
            PublisherClosedError: called in a forked child (the retirement runs in the parent).
            TimeoutError: not finished within ``timeout`` seconds.
        """
        if self._after is not None:
            self._after.wait(timeout)
        return self

    async def asettled(self) -> PublishReport:
        """Async twin of :meth:`settled`."""
        if self._after is not None:
            await self._after.wait_async()
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_after", None)  # a future does not leave its process
        return state

    @property
    def ok(self) -> bool:
        """True when every engine serves the new version (or already did)."""
        return bool(self.results) and all(r.ok for r in self.results)

    @property
    def bytes_moved(self) -> int:
        return sum(r.bytes_moved for r in self.results)

    @property
    def failed(self) -> list[EngineResult]:
        return [r for r in self.results if not r.ok]

    def raise_for_errors(self) -> PublishReport:
        """Raise the first engine's error (or a PublishError naming every failed engine)."""
        failed = self.failed
        if len(failed) == 1 and failed[0].error is not None:
            raise failed[0].error
        if failed:
            raise PublishError(
                f"{len(failed)} of {len(self.results)} engines failed: "
                + "; ".join(f"{r.engine} {r.url}: {r.error}" for r in failed),
                adapter=self.name,
                version=self.version,
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "served_name": self.served_name,
            "content_hash": self.content_hash,
            "nbytes": self.nbytes,
            "ok": self.ok,
            "bytes_moved": self.bytes_moved,
            "timings": dict(self.timings),
            "results": [r.to_dict() for r in self.results],
        }

    def __str__(self) -> str:
        lines = [
            f"publish {self.served_name} ({self.nbytes / 1e6:.2f} MB, hash {self.content_hash[:12]}): "
            + ("OK" if self.ok else f"{len(self.failed)} FAILED"),
            f"  {'engine':<8} {'url':<28} {'status':<9} {'transport':<9} {'bytes':>10} {'ms':>8}  detail",
        ]
        for r in self.results:
            total = sum(r.timings.values()) * 1000
            detail = str(r.error) if r.error is not None else r.reason
            if r.deferred:
                detail += f"; deferred (requests still use them): {', '.join(r.deferred)}"
            lines.append(
                f"  {r.engine:<8} {r.url[:28]:<28} {r.status:<9} {r.transport or '-':<9} {r.bytes_moved:>10} {total:>8.1f}  {detail}"
            )
        return "\n".join(lines)
