"""Publisher: deliver one adapter version to many engines, safely, step after step.

Per engine, concurrently, the critical path: pre-flight (capabilities, the engine's own rules,
capacity) → choose a transport (:mod:`lorasync._select`) → deliver (a disk publish hashes in its
write pass: :mod:`lorasync._digest`) → optional verify. Then, by default after ``publish``
returned (:mod:`lorasync._aftercare`): re-list, retire versions outside the retention window once
their requests drained (:mod:`lorasync._retention`), collect the run's files nothing may read
again (:mod:`lorasync._files`). Invariants:

* Versions are monotonic per (engine, name): an older version never replaces a newer one, and a
  version that concurrent publishers already superseded is taken out of service again.
* Identical content already served moves no bytes.
* A failure on one engine never blocks or changes the others, whatever it raised; a failed load
  or verify leaves the engine's previous version serving. The report says exactly what happened.
* A version with running or waiting requests is never unloaded (it is ``deferred``), a pinned
  one never, and a version's files outlive every engine that may reload them.
* Every publisher owns its own run of versions in the store: two jobs or a re-run never collide.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from lorasync._adapter import Adapter
from lorasync._aftercare import Aftercare
from lorasync._digest import PublishDigest
from lorasync._files import VersionFiles
from lorasync._handle import EngineHandle
from lorasync._loop import LoopThread, held
from lorasync._names import served_name, validate_name, validate_version
from lorasync._probe import Probe
from lorasync._report import EngineResult, PublishReport
from lorasync._retention import Ledger, Retention
from lorasync._select import TRANSPORTS, choose_transport
from lorasync.engines._engine import Engine
from lorasync.engines._registry import parse_engine_spec
from lorasync.errors import ConfigError, LoraSyncError
from lorasync.transports._transport import Transport
from lorasync.transports._base_weights import BaseWeights
from lorasync.transports._store import DiskStore
from lorasync.transports.disk import DiskTransport
from lorasync.transports.inplace import InPlaceTransport
from lorasync.transports.ipc import IPCTransport
from lorasync.transports.merged import DEFAULT_BUCKET_BYTES, MergedTransport

__all__ = ["Publisher"]

AdapterLike = Adapter | nn.Module | Mapping[str, torch.Tensor]


class Publisher:
    """Holds engines and per-engine version state across training steps.

    Args:
        engines: clients from ``lorasync.engines.connect`` or specs like
            ``"vllm:http://127.0.0.1:8000"``.
        name (`str`): the adapter's name; engines serve version N as ``name@vN``.
        transport (`str`): ``"auto"`` (per engine, from its capabilities), ``"disk"``, ``"ipc"``
            or ``"merged"``.
        keep (`int`): newest versions each engine keeps loaded. At least 1. Older ones are
            unloaded once no request uses them, then their files removed.
        root (`str | os.PathLike`, *optional*): disk transport root (default ``/dev/shm/lorasync``).
        run (`str`, *optional*): this publisher's run identity in the store (versions live in
            ``<root>/<name>/<run>/vN``); default a fresh one, so two jobs or a re-run never
            collide. Pass the same run to resume after a restart.
        base (`BaseWeights | str | os.PathLike`, *optional*): pristine base weights (a HF
            checkpoint dir or ``BaseWeights``); enables the merged fallback.
        bucket_bytes (`int`): merged fallback bucket size.
        verify (`Probe`, *optional*): default probe checked after every load.
        in_place (`bool`): serve every version under the plain ``name``, swapped atomically, on
            engines that support it safely (``capabilities().load_inplace``; the in-process PEFT
            engine). Refused elsewhere.
        grace, drain_timeout, max_deferred, max_staleness: retention options, see
            :class:`lorasync.Retention` (``retention=`` passes one whole).

    Example:
        >>> pub = Publisher(["vllm:http://127.0.0.1:8000"], name="policy")  # doctest: +SKIP
        >>> report = pub.publish(adapter, version=step)  # doctest: +SKIP
        >>> report.served_name  # 'policy@v<step>'  # doctest: +SKIP
    """

    def __init__(
        self,
        engines: Iterable[Engine | str] | Engine | str,
        *,
        name: str,
        transport: str = "auto",
        keep: int = 2,
        root: str | os.PathLike[str] | None = None,
        run: str | None = None,
        base: BaseWeights | str | os.PathLike[str] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        verify: Probe | None = None,
        in_place: bool = False,
        grace: float = 1.0,
        drain_timeout: float | None = 600.0,
        max_deferred: int = 8,
        max_staleness: int | None = None,
        retention: Retention | None = None,
    ) -> None:
        if isinstance(engines, (Engine, str)):
            engines = [engines]
        self.engines = [parse_engine_spec(e) for e in engines]
        if not self.engines:
            raise ConfigError("publish needs at least one engine")
        self.name = validate_name(name)
        if transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.retention = retention or Retention(keep=keep, grace=grace, drain_timeout=drain_timeout, max_deferred=max_deferred, max_staleness=max_staleness)
        self.transport = transport
        self.verify = verify
        self.in_place = in_place
        if in_place and transport == "merged":
            raise ConfigError("in_place=True serves adapters; it cannot combine with transport='merged'")
        self.store = DiskStore(root, run=run)
        self._disk = DiskTransport(self.store)
        if base is not None and not isinstance(base, BaseWeights):
            base = BaseWeights.from_pretrained(base)
        merged = MergedTransport(base, bucket_bytes=bucket_bytes) if base is not None else None
        self._candidates = {"disk": self._disk, "ipc": IPCTransport(), "merged": merged}
        self._in_place = InPlaceTransport(self._disk, files={"disk": True, "ipc": False}.get(transport)) if in_place else None
        self._files = VersionFiles(self.store, self.name, grace=self.retention.grace)
        self._ledgers = {id(e): Ledger() for e in self.engines}
        self._handles = {id(e): EngineHandle(e, self.name, self._files) for e in self.engines}
        self._pins: dict[int, int] = {}
        self._lock = threading.Lock()
        self._loop = LoopThread()
        self._care = Aftercare(
            name=self.name, engines=self.engines, ledgers=self._ledgers, handles=self._handles, files=self._files,
            retention=self.retention, pins=lambda: self.pinned, in_place=in_place,
        )

    @property
    def run(self) -> str:
        """This publisher's run identity in the store."""
        return self.store.run

    # -- public ---------------------------------------------------------------------------------

    def publish(self, adapter: AdapterLike, *, version: int, verify: Probe | None = None) -> PublishReport:
        """Publish ``adapter`` as ``version`` to every engine (blocking).

        Args:
            adapter: an :class:`Adapter`, or a PEFT model / state dict exported with
                ``lorasync.exporters.fsdp.export`` first.
            version (`int`): monotonic version, e.g. the trainer step.
            verify (`Probe`, *optional*): overrides the publisher's probe for this publish.

        Returns:
            `PublishReport`: per-engine outcome, returned once every engine serves the new version
            (or failed). Engine failures are reported, not raised; call
            ``report.raise_for_errors()`` to raise them. Old versions retire after it returned
            (``Retention.background``); ``report.settled()`` waits for that.

        Raises:
            InvalidNameError: bad version. AdapterError / ExportError: bad adapter.
        """
        return self._loop.run(self.apublish(adapter, version=version, verify=verify))

    async def apublish(self, adapter: AdapterLike, *, version: int, verify: Probe | None = None) -> PublishReport:
        """Async twin of :meth:`publish`."""
        version = validate_version(version)
        timings: dict[str, float] = {}
        start = time.perf_counter()
        if not isinstance(adapter, Adapter):
            from lorasync.exporters.fsdp import export

            adapter = await asyncio.to_thread(export, adapter)
            timings["export"] = time.perf_counter() - start
        probe = verify or self.verify
        digest = PublishDigest(adapter)
        async with held(self._lock):
            await self._care.previous_settled()
            self._disk.new_publish()
            done = await asyncio.gather(*(self._guarded(e, adapter, version, digest, probe) for e in self.engines))
            results = [r for r, _ in done]
            if all(r.status == "unchanged" for r in results):
                await asyncio.to_thread(self._disk.discard, self.name, version)  # written to learn its hash only
            content_hash = await digest.get()  # known unless every engine failed before needing it
            timings["hash"] = digest.seconds
            timings["total"] = time.perf_counter() - start
            names = {r.served_name for r in results if r.ok and r.served_name}
            if self.in_place:
                names = {self.name}
            report = PublishReport(
                name=self.name,
                version=version,
                served_name=names.pop() if len(names) == 1 else served_name(self.name, version),
                content_hash=content_hash,
                nbytes=adapter.nbytes,
                results=results,
                timings=timings,
            )
            # The new version serves: what is left (re-listing, retirement, file collection) runs
            # after this call returns, and the next publish waits for it before touching anything.
            after = self._care.after(done, version, timings)
            if self.retention.background and all(h.concurrent for h in self._handles.values()):
                report._after = (self._care.background.start(after), asyncio.get_running_loop())
            else:
                await after
        return report

    def pin(self, version: int) -> None:
        """Never retire ``version`` (on any engine) until :meth:`unpin`; pins nest."""
        version = validate_version(version)
        with self._lock:
            self._pins[version] = self._pins.get(version, 0) + 1

    def unpin(self, version: int) -> None:
        """Undo one :meth:`pin`; the version retires on the next publish once it is outside the window."""
        version = validate_version(version)
        with self._lock:
            left = self._pins.get(version, 0) - 1
            if left > 0:
                self._pins[version] = left
            else:
                self._pins.pop(version, None)

    @contextlib.contextmanager
    def lease(self, version: int) -> Iterator[str]:
        """Pin ``version`` for the ``with`` block (rollouts that run on it); yields its served name.

        Example:
            >>> with pub.lease(step) as model:  # doctest: +SKIP
            ...     rollouts = sample(model=model)
        """
        self.pin(version)
        try:
            yield served_name(self.name, version)
        finally:
            self.unpin(version)

    @property
    def pinned(self) -> frozenset[int]:
        return frozenset(self._pins)

    def collect(self) -> dict[str, list[str]]:
        """Retire what has drained since the last publish (and collect its files) now.

        Returns:
            ``{"retired": [...], "deferred": [...]}`` over all engines.
        """
        return self._loop.run(self.acollect())

    async def acollect(self, *, closing: bool = False) -> dict[str, list[str]]:
        """Async twin of :meth:`collect`."""
        async with held(self._lock):
            await self._care.previous_settled()
            return await self._care.retire_all(closing=closing)

    def restore_base(self) -> None:
        """Undo merged publishes: every engine this publisher merged into gets its pristine base
        weights back (adapter-serving engines are untouched)."""
        self._loop.run(self.arestore_base())

    async def arestore_base(self) -> None:
        merged = self._candidates["merged"]
        if merged is None:
            return
        for engine in self.engines:
            ledger = self._ledgers[id(engine)]
            if ledger.merged is not None:
                await merged.restore(engine, await self._handles[id(engine)].caps())  # type: ignore[attr-defined]
                ledger.merged = None

    def close(self) -> None:
        """Retire what has drained, close the engines' connections and stop the publisher's
        event loop (idempotent). Versions still in use stay loaded, with their files."""
        if self._loop.running or self._care.background.pending:
            with contextlib.suppress(LoraSyncError):
                self._loop.run(self.acollect(closing=True))
        self._release()
        for engine in self.engines:
            engine.close()

    async def aclose(self) -> None:
        """Async twin of :meth:`close`, for publishers driven with :meth:`apublish`."""
        with contextlib.suppress(LoraSyncError):
            await self.acollect(closing=True)
        await _aclose_all(self.engines)
        self._release()

    def _release(self) -> None:
        # Async clients opened on the publisher's loop are closed on it before it stops.
        if self._loop.running:
            self._loop.run(_aclose_all(self.engines))
        self._loop.stop()
        self.store.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- one engine -------------------------------------------------------------------------------

    async def _guarded(self, engine: Engine, adapter: Adapter, version: int, digest: PublishDigest, probe: Probe | None) -> tuple[EngineResult, Transport | None]:
        """One engine's publish up to serving; whatever it raises becomes this engine's typed,
        reported error. Returns the result, and the transport when the version must settle."""
        result = EngineResult(engine=engine.kind or type(engine).__name__, url=engine.url, status="failed")
        settle = None
        try:
            settle = await self._publish_one(engine, self._ledgers[id(engine)], result, adapter, version, digest, probe)
        except Exception as exc:
            self._care.failed(engine, result, exc, version)
        return result, settle

    async def _publish_one(self, engine: Engine, ledger: Ledger, result: EngineResult, adapter: Adapter, version: int, hashing: PublishDigest, probe: Probe | None) -> Transport | None:
        handle = self._handles[id(engine)]
        served = served_name(self.name, version)
        t0 = time.perf_counter()
        caps = await handle.caps()
        transport, result.reason = choose_transport(self.transport, engine, caps, adapter, self._candidates, in_place=self._in_place)
        result.transport = transport.name
        if isinstance(transport, InPlaceTransport):
            result.transport = "disk" if transport.uses_files(caps) else "ipc"
            result.served_name = self.name
        fresh = not ledger.synced
        if transport.versioned:
            await handle.sync(ledger)
            self._files.sweep_orphans(self._care.engine_lists())
        t_hash = time.perf_counter()
        if transport is self._disk and version > max(ledger.versions, default=-1):
            # A new version (every training step): written now and hashed in the same pass; its
            # files go again below if the engine already serves identical content.
            digest = await hashing.get(lambda: self._staged(adapter, version))
        else:
            digest = await hashing.get()
        t0 += time.perf_counter() - t_hash  # the write or hash is reported as such, not as preflight
        if transport.versioned and not fresh and ledger.unchanged(versioned=True, version=version, digest=digest):
            # About to move nothing on the strength of memory: ask the engine, which may have
            # restarted (and forgotten every adapter) since this publisher last looked.
            ledger.synced = False
            await handle.sync(ledger)
        if ledger.unchanged(versioned=transport.versioned, version=version, digest=digest):
            # The identical adapter is served under its earlier version's name: report that name.
            result.status = "unchanged"
            result.served_name = served_name(self.name, ledger.newest()) if transport.versioned else (self.name if self.in_place else "")  # type: ignore[arg-type]
            result.reason = f"already serving identical content ({digest[:12]}); nothing moved"
            return None
        ledger.check_monotonic(self.name, versioned=transport.versioned, version=version, digest=digest)
        if transport.versioned:
            result.retired = await handle.make_room(ledger, self.retention, self.pinned, caps)
        result.timings["preflight"] = time.perf_counter() - t0

        with_files = transport.versioned and transport.name == "disk"
        if with_files:
            self._files.loading(version, handle.engine_id, reloads=handle.reloads)
        previous = ledger.in_place
        try:
            delivery = await transport.deliver(adapter, engine, caps, name=self.name, version=version, served=served)
        except BaseException:
            if with_files:
                self._files.released(version, handle.engine_id, reloads=handle.reloads)
            raise
        result.timings.update(delivery.timings)
        result.bytes_moved = delivery.bytes_moved
        result.served_name = delivery.served_name
        if isinstance(transport, InPlaceTransport):
            ledger.in_place = (version, digest, adapter)
        elif transport.versioned:
            ledger.versions[version] = digest
        else:
            ledger.merged = (version, digest)

        if probe is not None:
            t0 = time.perf_counter()
            await handle.verify(ledger, transport, probe, version, previous=previous)
            result.timings["verify"] = time.perf_counter() - t0
            result.reason += "; verified through the engine"
        result.status = "loaded"
        return transport if transport.versioned else None

    async def _staged(self, adapter: Adapter, version: int) -> str:
        return (await self._disk.stage(adapter, self.name, version))[0]



async def _aclose_all(engines: Iterable[Engine]) -> None:
    for engine in engines:
        await engine.aclose()
