"""Publisher: deliver one adapter version to many engines, safely, step after step.

Per engine, concurrently: pre-flight (capabilities, the engine's rules, capacity) → a transport
(:mod:`lorasync.publisher._select`) → deliver (a disk publish hashes in its write pass: :mod:`lorasync.publisher._digest`)
→ optional verify. Then, after ``publish`` returned (:mod:`lorasync.publisher._aftercare`): re-list, retire versions
outside the retention window once drained (:mod:`lorasync.publisher._retention`), collect files (:mod:`lorasync.publisher._files`). Invariants:

* Versions are monotonic per (engine, name): an older version never replaces a newer one, and a version
  that concurrent publishers already superseded is taken out of service again.
* A failure on one engine never blocks or changes the others; a failed load or verify leaves its previous version.
* A version with running or waiting requests is never unloaded (it is ``deferred``), a pinned one never, and
  a version's files outlive every engine that may reload them. Identical content served moves no bytes. Every
  publisher owns its own run of versions in the store: two jobs or a re-run never collide.
* No call hangs (:mod:`lorasync.runtime._lifecycle`): a blocking call where it would deadlock, a call after
  ``close`` or in a forked child are typed errors; ``close`` fails the calls waiting for the lock and lets the
  one in flight finish (a cancelled delivery or withdrawal runs to its end: :mod:`lorasync.publisher._interrupted`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lorasync.adapter._adapter import Adapter
from lorasync.publisher._aftercare import Aftercare
from lorasync.publisher._digest import PublishDigest, watch_optimizer_steps
from lorasync.publisher._files import VersionFiles
from lorasync.publisher._handle import EngineHandle
from lorasync.publisher._interrupted import keep_cancelled, left_running, settle_to_the_end, to_the_end, withdraw_cancelled
from lorasync.runtime._lifecycle import async_entry, blocking
from lorasync.runtime._loop import exiting, gather_all, to_thread_untracked
from lorasync.runtime._looplock import held
from lorasync.adapter._names import served_name, validate_name, validate_version
from lorasync.adapter._probe import Probe
from lorasync.publisher._report import EngineResult, PublishReport
from lorasync.publisher._retention import Ledger, Retention
from lorasync.publisher._select import TRANSPORTS, choose_transport
from lorasync.publisher._session import PublisherLife, refuse_duplicates
from lorasync.engines._engine import Capabilities, Engine
from lorasync.engines._registry import engine_list
from lorasync.errors import AdapterAlreadyLoadedError, ConfigError, EngineUnavailableError, VerificationError
from lorasync.transports._transport import Transport
from lorasync.transports._base_weights import BaseWeights
from lorasync.transports._store import DiskStore
from lorasync.transports.disk import DiskTransport
from lorasync.transports.inplace import InPlaceTransport
from lorasync.transports.ipc import IPCTransport
from lorasync.transports.merged import MergedTransport

__all__ = ["Publisher"]

log = logging.getLogger("lorasync.publish")

AdapterLike = Adapter | nn.Module | Mapping[str, torch.Tensor]


class Publisher(PublisherLife):
    """Holds engines and per-engine version state across training steps.

    Args:
        engines: clients from ``lorasync.engines.connect`` or specs like
            ``"vllm:http://127.0.0.1:8000"``.
        name (`str`): the adapter's name; engines serve version N as ``name@vN``.
        transport (`str`): ``"auto"`` (per engine, from its capabilities), ``"disk"``, ``"ipc"``
            or ``"merged"``.
        keep (`int`): newest versions each engine keeps loaded. At least 1. Older ones are
            unloaded once no request uses them, then their files removed.
        root (`str | os.PathLike`, *optional*): disk transport root (default ``/dev/shm/lorasync-<uid>``, per user).
        run (`str`, *optional*): this publisher's run identity in the store (versions live in
            ``<root>/<name>/<run>/vN``); default a fresh one, so two jobs or a re-run never
            collide. Pass the same run to resume after a restart.
        base (`BaseWeights | str | os.PathLike`, *optional*): pristine base weights (a HF
            checkpoint dir or ``BaseWeights``); enables the merged fallback.
        bucket_bytes (`int`, *optional*): merged bucket size; default 1 GiB folded on a GPU, else 256 MiB.
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

    # A Fleet's tenant: the fleet planned every engine's slots across tenants before the round,
    # so make_room unloads only what the load needs (lorasync.publisher._capacity.plan_room).
    _room_planned = False

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
        bucket_bytes: int | None = None,
        verify: Probe | None = None,
        in_place: bool = False,
        grace: float = 1.0,
        drain_timeout: float | None = 600.0,
        max_deferred: int = 8,
        max_staleness: int | None = None,
        retention: Retention | None = None,
    ) -> None:
        self._made: list[Engine] = []  # its own clients (built from spec strings), closed with it
        self.engines = engine_list(engines, what="publish", made=self._made)
        refuse_duplicates(self.engines)
        self.name = validate_name(name)
        if not isinstance(transport, str) or transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if retention is not None and not isinstance(retention, Retention):
            raise ConfigError(f"retention must be a lorasync.Retention (or None to use keep=, grace=, ...), got {type(retention).__name__}")
        self.retention = retention or Retention(keep=keep, grace=grace, drain_timeout=drain_timeout, max_deferred=max_deferred, max_staleness=max_staleness)
        if not isinstance(in_place, bool):
            raise ConfigError(f"in_place must be True or False, got {in_place!r}")
        if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1):
            raise ConfigError(f"bucket_bytes must be an int >= 1 (bytes per merged-update bucket), got {bucket_bytes!r}")
        if verify is not None and not isinstance(verify, Probe):
            raise ConfigError(f"verify must be a lorasync.Probe (Probe.from_model(...)) or None, got {type(verify).__name__}")
        self.transport = transport
        self.verify = verify
        self.in_place = in_place
        if in_place and transport == "merged":
            raise ConfigError("in_place=True serves adapters; it cannot combine with transport='merged'")
        self.store = DiskStore(root, run=run)
        self._disk = DiskTransport(self.store)
        if base is not None and not isinstance(base, BaseWeights):
            if not isinstance(base, (str, os.PathLike)):
                raise ConfigError(f"base must be BaseWeights or the path of the pristine base model, got {type(base).__name__}")
            base = BaseWeights.from_pretrained(base)
        merged = MergedTransport(base, bucket_bytes=bucket_bytes) if base is not None else None
        self._candidates = {"disk": self._disk, "ipc": IPCTransport(), "merged": merged}
        self._in_place = InPlaceTransport(self._disk, files={"disk": True, "ipc": False}.get(transport)) if in_place else None
        self._probed = verify is not None  # a restore can happen: in-place versions keep an owned copy
        # Called when a publish has hashed (on disk: written) the adapter and hands it to an engine:
        # a Fleet holds back hashing its other tenants until then (they would slow what came before).
        self._on_staged: Callable[[], None] | None = None
        watch_optimizer_steps()  # before the first publish, so a step already running then is seen
        self._files = VersionFiles(self.store, self.name, grace=self.retention.grace)
        self._ledgers = {id(e): Ledger() for e in self.engines}
        self._handles = {id(e): EngineHandle(e, self.name, self._files) for e in self.engines}
        self._start_life()
        self._care = Aftercare(
            name=self.name, engines=self.engines, ledgers=self._ledgers, handles=self._handles, files=self._files,
            retention=self.retention, pins=lambda: self.pinned, in_place=in_place, rescue=self._loop, guard=self._sync_guard,
        )

    @property
    def run(self) -> str:
        """This publisher's run identity in the store."""
        return self.store.run

    # -- public ---------------------------------------------------------------------------------

    @blocking("await pub.apublish(adapter, version=...)")
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

    async def apublish(self, adapter: AdapterLike, *, version: int, verify: Probe | None = None) -> PublishReport:
        """Async twin of :meth:`publish`."""
        return await self._apublish(adapter, version=version, verify=verify)

    @async_entry("pub.apublish()")
    async def _apublish(self, adapter: AdapterLike, *, version: int, verify: Probe | None = None, digest: PublishDigest | None = None, restore: bool = False) -> PublishReport:
        """:meth:`apublish`; ``digest``: the publish's view of ``adapter`` begun before the call
        (a Fleet round hashed it, or copied it, under that digest's torn-read watch); ``restore``:
        load ``version`` again only where the engine does not list it (a Fleet restore)."""
        version = validate_version(version)
        if verify is not None and not isinstance(verify, Probe):  # before anything is exported or loaded
            raise ConfigError(f"verify must be a lorasync.Probe (Probe.from_model(...)) or None, got {type(verify).__name__}")
        if digest is not None and digest.adapter is not adapter:
            raise ConfigError("a publish's digest must be of the adapter it publishes")
        # Cancelled before every engine recorded it (waiting for the lock, exporting, loading): an
        # engine may serve a load no one recorded, or none serves it, so lease(version) refuses it.
        with self._cancel_noted(version, recorded=lambda: restore or all(ledger.holds(version) for ledger in self._ledgers.values())):
            timings: dict[str, float] = {}
            start = time.perf_counter()
            if not isinstance(adapter, Adapter):
                from lorasync.exporters.fsdp import export

                adapter = await to_thread_untracked(export, adapter)
                timings["export"] = time.perf_counter() - start
            probe = verify or self.verify
            self._probed = self._probed or probe is not None  # in-place versions keep a copy to restore from now
            # Cancelled after its write: files no engine recorded go (in-place versions serve from theirs).
            recorded = lambda: self.in_place or any(version in ledger.versions for ledger in self._ledgers.values())  # noqa: E731
            async with held(self._lock), self._disk.cancel_guard(self.name, version, recorded=recorded):
                await self._care.previous_settled()
                self._disk.new_publish()
                # From here the publish reads the tensors: a change tears it (a Fleet round's digest watched earlier).
                digest = digest if digest is not None else PublishDigest(adapter)
                done = await gather_all(*(self._guarded(e, adapter, version, digest, probe, restore=restore) for e in self.engines))
                if len({r.served_name for r, _ in done if r.ok and r.served_name}) > 1:
                    # Engines serving this content under an older name load it as this version too, so
                    # report.served_name (what callers put in model=) is served by every engine that is ok.
                    again = [i for i, (r, _) in enumerate(done) if r.status == "unchanged"]
                    for i, redone in zip(again, await gather_all(*(self._guarded(self.engines[i], adapter, version, digest, probe, reuse=False, restore=restore) for i in again))):
                        done[i] = redone
                results = [r for r, _ in done]
                if all(r.status == "unchanged" for r in results) or digest.torn is not None:
                    await to_thread_untracked(self._disk.discard, self.name, version)  # written to learn its hash only, or torn
                content_hash = await digest.get(check=False)  # known unless every engine failed before needing it
                timings["hash"] = digest.seconds
                timings["total"] = time.perf_counter() - start
                names = {self.name} if self.in_place else {r.served_name for r in results if r.ok and r.served_name}
                report = PublishReport(
                    name=self.name,
                    version=version,
                    served_name=names.pop() if len(names) == 1 else served_name(self.name, version),
                    content_hash=content_hash,
                    nbytes=adapter.nbytes,
                    results=results,
                    timings=timings,
                )
                if report.ok:
                    self._note_served(version, report.served_name, content_hash)  # lease(version) names what serves it
                elif any(isinstance(r.error, VerificationError) for r in results):
                    self._note_unverified(version)  # not served where it failed: lease(version) refuses it
                # The new version serves: what is left (re-listing, retirement, file collection) runs
                # after this call returns, and the next publish waits for it before touching anything.
                after = self._care.after(done, version, timings)
                if self.retention.background and all(h.concurrent for h in self._handles.values()) and not exiting():
                    report._after = self._care.start(after)
                else:
                    await after
        return report

    @blocking("await pub.arestore_base()")
    def restore_base(self) -> None:
        """Undo merged publishes: every engine this publisher merged into gets its pristine base
        weights back (adapter-serving engines are untouched)."""

    @async_entry("pub.arestore_base()")
    async def arestore_base(self) -> None:
        """Async twin of :meth:`restore_base`."""
        merged = self._candidates["merged"]
        if merged is None:
            return
        async with held(self._lock):
            for engine in self.engines:
                ledger = self._ledgers[id(engine)]
                if ledger.merged is not None:
                    await merged.restore(engine, await self._handles[id(engine)].caps())  # type: ignore[attr-defined]
                    ledger.merged = None

    # -- one engine -------------------------------------------------------------------------------

    async def _guarded(self, engine: Engine, adapter: Adapter, version: int, digest: PublishDigest, probe: Probe | None, *, reuse: bool = True, restore: bool = False) -> tuple[EngineResult, Transport | None]:
        """One engine's publish up to serving; whatever it raises becomes this engine's typed, reported
        error. Returns the result, and the transport when the version must settle (``reuse``: dedup)."""
        result = EngineResult(engine=engine.kind or type(engine).__name__, url=engine.url, status="failed")
        settle = None
        handle, ledger = self._handles[id(engine)], self._ledgers[id(engine)]
        try:
            # A cancelled engine call runs on in its thread: the next publish waits (bounded), then undoes it.
            with handle.cancelled.watch(ledger, version):
                await handle.cancelled.reconcile(ledger)
                settle = await self._publish_one(engine, ledger, result, adapter, version, digest, probe, reuse=reuse, restore=restore)
        except (Exception, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError) and getattr(asyncio.current_task(), "cancelling", lambda: 1)():
                raise  # this publish was cancelled (else the engine's own loop dropped its call: a failure; 3.10 cannot tell)
            self._care.failed(engine, result, exc if isinstance(exc, Exception) else EngineUnavailableError(f"{engine.url}: its call was cancelled on the engine's side"), version)
        return result, settle

    async def _publish_one(self, engine: Engine, ledger: Ledger, result: EngineResult, adapter: Adapter, version: int, hashing: PublishDigest, probe: Probe | None, *, reuse: bool, restore: bool) -> Transport | None:
        handle = self._handles[id(engine)]
        t0 = time.perf_counter()
        caps = await handle.caps()
        transport, result.reason = choose_transport(self.transport, engine, caps, adapter, self._candidates, in_place=self._in_place)
        result.transport = transport.name
        in_place = isinstance(transport, InPlaceTransport)
        if in_place:
            result.transport = "disk" if transport.uses_files(caps) else "ipc"
            result.served_name = self.name
        if not transport.versioned:
            await handle.check_memory(ledger, transport)  # what it swapped in or merged counts only while served
        ledger.synced = ledger.synced and not (restore and transport.versioned)  # a restore acts on what the engine lists now
        fresh = not ledger.synced
        if transport.versioned:
            await handle.sync(ledger)
            await handle.withdraw_unverified(ledger)  # an earlier withdrawal that failed: before anything loads
            self._files.sweep_orphans(self._care.engine_lists())
        t_hash = time.perf_counter()
        # A new version is written now and hashed in that pass (its files go if the engine serves the same).
        new = transport is self._disk and version > max(ledger.versions, default=-1)
        digest = await hashing.get((lambda: self._staged(adapter, version)) if new else None)
        t0 += time.perf_counter() - t_hash  # the write or hash is reported as such, not as preflight
        if reuse and transport.versioned and not fresh and ledger.unchanged(versioned=True, version=version, digest=digest):
            # About to move nothing on the strength of memory: ask the engine, which may have
            # restarted (and forgotten every adapter, or been given another job's) since.
            ledger.synced = False
            await handle.sync(ledger)
        # A restore loads only where the version is missing: one listed from a load whose content
        # cannot be known is left alone, neither hashed nor loaded over (design invariant 8).
        kept = restore and transport.versioned and ledger.listed_unknown(version)
        if reuse and (kept or ledger.unchanged(versioned=transport.versioned, version=version, digest=digest)):
            # The identical adapter is served under its earlier version's name: report that name.
            result.status = "unchanged"
            result.served_name = served_name(self.name, ledger.newest()) if transport.versioned else (self.name if self.in_place else "")  # type: ignore[arg-type]
            result.reason = "listed already; a restore loads only where it is missing" if kept else f"already serving identical content ({digest[:12]}); nothing moved"
            if probe is not None:  # reported served only once the engine reproduces the probe (invariant 11)
                await handle.verify_served(probe, result.served_name or None)
                result.reason += "; verified through the engine"
            return None
        ledger.check_monotonic(self.name, versioned=transport.versioned, version=version, digest=digest)
        if transport.versioned:
            result.retired = await handle.make_room(ledger, self.retention, self.pinned, caps, planned=self._room_planned)
        # The trainer's tensors (zero-copy), or this publish's owned copy where lorasync keeps the
        # version to put it back (invariant 7): every merge, in-place swaps once a probe is used.
        files = in_place and transport.uses_files(caps)
        keep = transport is self._candidates["merged"] or (in_place and not files and self._probed)
        payload = await hashing.owned() if keep else adapter
        result.timings["preflight"] = time.perf_counter() - t0

        with_files = transport.versioned and transport.name == "disk"
        if with_files:
            self._files.loading(version, handle.engine_id, reloads=handle.reloads)
        previous = ledger.in_place if in_place else ledger.merged
        if self._on_staged is not None:  # a Fleet: hashing its other tenants may begin
            self._on_staged()
        path = self._files.path_of(version) if with_files or files else None
        live = payload is adapter and not (transport is self._disk and hashing.from_write)  # it reads the trainer's tensors
        # A cancel waits (bounded) with a probe and in place or merged: else a call left running serves the next step.
        delivering = asyncio.ensure_future(transport.deliver(payload, engine, caps, name=self.name, version=version, served=served_name(self.name, version)))
        try:
            delivery = await (to_the_end(delivering) if probe is not None or not transport.versioned else delivering)
        except BaseException as exc:
            landed = isinstance(exc, asyncio.CancelledError) and delivering.done() and not delivering.cancelled() and delivering.exception() is None
            if isinstance(exc, asyncio.CancelledError) and not delivering.done():  # waited for past the bound
                left_running(handle, ledger, transport, version, delivering)
            elif probe is not None and isinstance(exc, asyncio.CancelledError):
                await withdraw_cancelled(handle, ledger, transport, version, caps=caps, previous=previous, cancelled_at=getattr(exc, "cancelled_at", None))
            elif landed:  # recorded like any load if exact, else taken out (publisher/_interrupted)
                await keep_cancelled(handle, ledger, transport, version, hashing, digest, caps=caps, previous=previous, path=path, restore=path if files else payload, live=live, cancelled_at=getattr(exc, "cancelled_at", None))
                raise
            elif transport.versioned and not with_files and not isinstance(exc, AdapterAlreadyLoadedError):
                # The load may have landed before its answer was lost (dropped, timed out, the engine
                # unreachable right after). A tensor load names no files that say what it holds: if
                # the engine lists this version later, it is unverified (never reported served, taken
                # out before the next load) rather than another job's, refused as stale.
                ledger.unverified.add(version)
                ledger.synced = False
            if with_files:
                self._files.released(version, handle.engine_id, reloads=handle.reloads)
            raise
        result.timings.update(delivery.timings)
        result.bytes_moved, result.served_name = delivery.bytes_moved, delivery.served_name
        settling = False  # once True, a cancel waits (settle_to_the_end) for the take-out or the record
        try:
            if live and (torn := hashing.changed()) is not None:
                settling = True
                await settle_to_the_end(handle, ledger, transport, version, handle.withdraw(ledger, transport, version, caps=caps, previous=previous))  # it read tensors that changed
                raise hashing.error(torn, f"while {result.engine} loaded them")
            if probe is not None:
                t0 = time.perf_counter()
                await handle.verify(ledger, transport, probe, version, previous=previous, caps=caps)
                result.timings["verify"] = time.perf_counter() - t0
                result.reason += "; verified through the engine"
            # Counted as served only now (invariant 11): reported ``unchanged`` later, leased, restored from.
            settling = True
            await settle_to_the_end(handle, ledger, transport, version, handle.delivered(ledger, transport, version, digest, path=path, restore=path if files else payload))
        except asyncio.CancelledError:
            if probe is not None and not settling:  # cancelled before the probe passed: never leave unverified weights serving
                await withdraw_cancelled(handle, ledger, transport, version, caps=caps, previous=previous)
            raise
        result.status = "loaded"
        return transport if transport.versioned else None

    async def _staged(self, adapter: Adapter, version: int) -> str:
        return (await self._disk.stage(adapter, self.name, version))[0]
