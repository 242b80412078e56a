"""PublishReport: what one publish did, per engine, with timings and typed errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lorasync.errors import LoraSyncError, PublishError

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
    # The retirement this publish left running (``Retention.background``): its future and loop.
    _after: tuple[Any, Any] | None = field(default=None, repr=False, compare=False)

    def settled(self, timeout: float | None = None) -> PublishReport:
        """Wait until this publish's retirement of old versions (and collection of their files)
        finished; then ``retired``, ``deferred`` and ``timings`` are final. Returns ``self``.

        The next publish, ``Publisher.collect`` and ``close`` wait for it anyway; call this only
        to look at the engine's state right after a publish.

        Raises:
            RuntimeError: called on the event loop that runs it (use :meth:`asettled`).
            TimeoutError: not finished within ``timeout`` seconds.
        """
        from lorasync._loop import wait_done

        if self._after is not None:
            wait_done(self._after[0], self._after[1], timeout)
        return self

    async def asettled(self) -> PublishReport:
        """Async twin of :meth:`settled`."""
        import asyncio

        if self._after is not None and not self._after[0].done():
            await asyncio.wrap_future(self._after[0])
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_after"] = None  # a future does not leave its process
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
