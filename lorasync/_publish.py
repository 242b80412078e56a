"""Publisher: deliver one adapter version to many engines, safely, step after step.

Per engine, concurrently: pre-flight (capabilities, the engine's own rules, capacity) → choose a
transport (:mod:`lorasync._select`) → deliver → optional verify → retire versions outside the
retention window once their requests drained (:mod:`lorasync._retention`). Then the run's files
that nothing may read again are collected (:mod:`lorasync._files`). Invariants:

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
from lorasync._files import VersionFiles
from lorasync._handle import EngineHandle
from lorasync._loop import LoopThread, held
from lorasync._names import served_name, validate_name, validate_version
from lorasync._probe import Probe
from lorasync._report import EngineResult, PublishReport
from lorasync._retention import Ledger, Retention
from lorasync._select import TRANSPORTS, choose_transport
from lorasync.engines._base import Engine
from lorasync.engines._registry import parse_engine_spec
from lorasync.errors import ConfigError, EngineError, LoraSyncError
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
            `PublishReport`: per-engine outcome. Engine failures are reported, not raised; call
            ``report.raise_for_errors()`` to raise them.

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
        t0 = time.perf_counter()
        digest = await asyncio.to_thread(lambda: adapter.content_hash)
        timings["hash"] = time.perf_counter() - t0
        async with held(self._lock):
            self._disk.new_publish()
            results = await asyncio.gather(*(self._guarded(e, adapter, version, digest, probe) for e in self.engines))
            t0 = time.perf_counter()
            await self._collect_files(version)
            timings["gc"] = time.perf_counter() - t0
        timings["total"] = time.perf_counter() - start
        names = {r.served_name for r in results if r.ok and r.served_name}
        if self.in_place:
            names = {self.name}
        return PublishReport(
            name=self.name,
            version=version,
            served_name=names.pop() if len(names) == 1 else served_name(self.name, version),
            content_hash=digest,
            nbytes=adapter.nbytes,
            results=list(results),
            timings=timings,
        )

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
        out: dict[str, list[str]] = {"retired": [], "deferred": []}
        async with held(self._lock):
            for engine in self.engines if not self.in_place else ():
                ledger = self._ledgers[id(engine)]
                with contextlib.suppress(LoraSyncError):
                    if ledger.synced:
                        done, waiting = await self._handles[id(engine)].retire(ledger, self.retention, self.pinned, closing=closing)
                        out["retired"] += done
                        out["deferred"] += waiting
            newest = max((v for ledger in self._ledgers.values() for v in ledger.versions), default=None)
            if newest is not None:
                await self._collect_files(newest)
        return out

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
        if self._loop.running:
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

    async def _guarded(self, engine: Engine, adapter: Adapter, version: int, digest: str, probe: Probe | None) -> EngineResult:
        """One engine's publish; whatever it raises becomes this engine's typed, reported error."""
        result = EngineResult(engine=engine.kind or type(engine).__name__, url=engine.url, status="failed")
        ledger = self._ledgers[id(engine)]
        try:
            await self._publish_one(engine, ledger, result, adapter, version, digest, probe)
        except LoraSyncError as exc:
            result.error = exc
        except Exception as exc:  # a bug or an untranslated foreign error: report it, typed
            where = f"{result.engine} at {engine.url or '(in-process)'}"
            result.error = EngineError(f"{where} failed unexpectedly: {type(exc).__name__}: {exc}", engine=result.engine, url=engine.url, adapter=served_name(self.name, version))
            result.error.__cause__ = exc
        if result.error is not None:
            self._handles[id(engine)].forget_caps()  # re-probe next time: the engine may have restarted
            ledger.synced = False
        return result

    async def _publish_one(self, engine: Engine, ledger: Ledger, result: EngineResult, adapter: Adapter, version: int, digest: str, probe: Probe | None) -> None:
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
            self._files.sweep_orphans(self._engine_lists())
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
            return
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
        if transport.versioned:
            t0 = time.perf_counter()
            await handle.settle(ledger, transport, version, self.retention, self.pinned)
            done, result.deferred = await handle.retire(ledger, self.retention, self.pinned)
            result.retired += done
            result.timings["retire"] = time.perf_counter() - t0
        result.status = "loaded"

    def _engine_lists(self) -> dict[str, set[str]]:
        ids = {id(e): self._handles[id(e)].engine_id for e in self.engines}
        return {ids[k]: {served_name(self.name, v) for v in ledger.versions} for k, ledger in self._ledgers.items() if ledger.synced}

    async def _collect_files(self, current: int) -> None:
        """Delete this run's version directories nothing may read again (best effort)."""
        if self.in_place:
            swapped = {ledger.in_place[0] for ledger in self._ledgers.values() if ledger.in_place is not None}
            await self._files.collect(current=current, keep=self.retention.keep, held=swapped, pins=self.pinned, in_use=())
            return
        if any(not ledger.synced for ledger in self._ledgers.values()):
            return  # an engine's view is unknown (it failed): keep every file
        loaded = self._files.held() | {v for ledger in self._ledgers.values() for v in ledger.versions}
        in_use: set[str] | None = set()
        for handle in self._handles.values():
            if handle.reloads:  # the engines that may re-read a version's files
                busy = handle.last_in_use
                in_use = None if busy is None or in_use is None else in_use | busy
        await self._files.collect(current=current, keep=self.retention.keep, held=loaded, pins=self.pinned, in_use=in_use)


async def _aclose_all(engines: Iterable[Engine]) -> None:
    for engine in engines:
        await engine.aclose()
