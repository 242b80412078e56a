"""Engines joining and leaving a running :class:`~lorasync.Fleet` (``add_engine``, ``remove_engine``).

Adding an engine (a new rollout node, a replica that came back under a new address) does, under
the fleet's lock so that no round plans or loads meanwhile:

1. probe its capabilities once (shared by every tenant, like the engines given at construction);
2. list it once, and refuse an engine that already serves versions under a tenant's name: the
   fleet cannot tell them from another job's (the same fence as ``register``);
3. check its slot budget: every tenant's current version must fit, or a ``CapacityError`` naming
   the tenants and slots is raised before anything is loaded, and the engine is not added;
4. give every tenant's :class:`~lorasync.Publisher` a handle and a ledger for it, so retention,
   leases, verification, retirements and the next rounds manage it like the others;
5. load every tenant's current version there from lorasync's own copy of it (the owned snapshot,
   else its files in the store; a restore: current versions only, never windows, versions not
   bumped) and report the tenants ``restored``.

Removing one unloads the fleet's versions there once their requests and leases drained (as
``retire`` does), takes it out of every tenant's publisher, and releases its hold on the
versions' files: files another engine still serves stay, the rest are collected.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from lorasync.fleet._plan import FleetReport, SlotNeed, TenantReport, plan_slots
from lorasync.publisher._handle import EngineHandle
from lorasync.runtime._lifecycle import Lifecycle, async_entry, blocking
from lorasync.runtime._loop import LoopThread
from lorasync.runtime._looplock import LoopLock, held
from lorasync.adapter._names import parse_served_name
from lorasync.publisher._publisher import Publisher
from lorasync.publisher._retention import Ledger, check_timeout
from lorasync.publisher._session import _engine_key, refuse_duplicates
from lorasync.fleet._tenant import Tenant, republish, unload_drained, where
from lorasync.engines._engine import Capabilities, Engine
from lorasync.engines._group import EngineGroup
from lorasync.engines._registry import parse_engine_spec
from lorasync.errors import CapacityError, ConfigError, LoraSyncError

__all__ = ["FleetEngines"]


class FleetEngines:
    """The engine half of :class:`~lorasync.Fleet` (see the module docstring); the fleet's
    constructor makes the parts it uses (listed below as annotations)."""

    engines: list[Engine]
    tenants: dict[str, Tenant]
    _caps: dict[int, Capabilities]
    _lock: LoopLock
    _loop: LoopThread
    _life: Lifecycle

    @blocking("await fleet.aadd_engine(engine)")
    def add_engine(self, engine: Engine | str) -> FleetReport:
        """Add an engine to the running fleet: every tenant's current version is loaded there
        (restored from lorasync's own copy of it, versions unchanged), and every tenant's
        publisher manages it from now on (retention, leases, verification, rounds).

        Args:
            engine: an engine client or a spec like ``"vllm:http://10.0.0.7:8000"``.

        Returns:
            `FleetReport`: each tenant with a current version ``restored`` on it (``restored_on``
            names the engine), or ``failed`` with its error (the next round restores it there).

        Raises:
            ConfigError: the engine is in the fleet already, or it serves versions under a
                tenant's name (unload them first).
            CapacityError: its adapter slots cannot hold every tenant's current version; nothing
                was loaded and it was not added.
            EngineError: it did not answer; it was not added.
        """

    @async_entry("fleet.aadd_engine()")
    async def aadd_engine(self, engine: Engine | str) -> FleetReport:
        """Async twin of :meth:`add_engine`."""
        built = isinstance(engine, str)  # a connection the fleet made: closed again if refused
        engine = parse_engine_spec(engine)
        if isinstance(engine, EngineGroup):
            if built:
                await engine.aclose()
            raise ConfigError(
                f"add_engine takes one engine; {engine.kind}:{engine.url} stands for several (each server behind it): "
                "add them one by one (for e in group.members(): fleet.add_engine(e)), each with its own report"
            )
        try:
            return await self._add(engine)
        except BaseException:
            if built and not any(e is engine for e in self.engines):
                await engine.aclose()
                engine.close()
            raise

    async def _add(self, engine: Engine) -> FleetReport:
        report = FleetReport()
        async with held(self._lock):
            refuse_duplicates([*self.engines, engine])
            caps = await engine.acapabilities()  # probed once, shared by every tenant
            listing = await engine.alist_adapters()
            ours = sorted(n for n in listing if (parse_served_name(n) or ("",))[0] in self.tenants)
            if ours:
                raise ConfigError(
                    f"{where(engine)} already serves {', '.join(ours)}: versions under this fleet's tenant names that the fleet "
                    "did not load there (another job's, or left by a removal with unload=False). The fleet cannot tell them "
                    "from its own: unload them from the engine (engine.unload_adapter(name)), then add it again. Nothing was loaded"
                )
            current = {n: t for n, t in self.tenants.items() if t.version is not None and not t.retiring}
            if caps.max_loras is not None:
                # Tenants never published yet keep the slot their registration booked.
                needs = [SlotNeed(n, t.version, first=True) for n, t in self.tenants.items() if not t.retiring]
                try:
                    plan_slots(needs, capacity=caps.max_loras, foreign=listing, where=where(engine), soft=caps.reloads_from_path, engine=engine.kind, url=engine.url)
                except CapacityError as exc:
                    message = f"cannot add {where(engine)} to the fleet: {exc.message} The engine was not added and nothing was loaded on it."
                    raise CapacityError(message, **exc.context) from None
            self._caps[id(engine)] = caps
            for tenant in self.tenants.values():  # retiring ones too: their last passes list every engine
                attach(tenant.publisher, engine, caps)
            self.engines.append(engine)
            await asyncio.gather(*(restore_on(tenant, engine, report) for tenant in current.values()))
        return report

    @blocking("await fleet.aremove_engine(engine)")
    def remove_engine(self, engine: Engine | str, *, timeout: float | None = None, unload: bool = True) -> list[str]:
        """Take an engine out of the fleet: the fleet's versions there are unloaded once their
        requests and leases drained (as ``retire`` does; other rounds go on meanwhile), and their
        files stay while another engine serves them.

        Args:
            engine: the engine object, or its URL as the fleet has it.
            timeout (`float`, *optional*): seconds to wait for requests (default each tenant's
                ``drain_timeout``); then they are unloaded anyway (``RetentionWarning``).
            unload (`bool`): False for an engine that is gone (a dead node): nothing is asked of it.

        Returns:
            The served names unloaded. The engine object stays open: close it when done.

        Raises:
            ConfigError: not one of the fleet's engines, or its only one.
            EngineError: it failed while unloading; it stays in the fleet (call again, or pass
                ``unload=False``).
        """

    @async_entry("fleet.aremove_engine()")
    async def aremove_engine(self, engine: Engine | str, *, timeout: float | None = None, unload: bool = True) -> list[str]:
        """Async twin of :meth:`remove_engine`."""
        if not isinstance(unload, bool):
            raise ConfigError(f"unload must be True or False, got {unload!r}")
        check_timeout(timeout)
        async with held(self._lock):
            found = _find(self.engines, engine)
            self._only(found)
        since, gone = time.monotonic(), []
        while unload:
            async with held(self._lock):  # one pass at a time; other rounds go on between passes
                self._still_in(found)
                passes = []
                for tenant in self.tenants.values():
                    limit = timeout if timeout is not None else tenant.publisher.retention.drain_timeout
                    force = limit is not None and time.monotonic() - since >= limit
                    passes.append(unload_drained(tenant, found, since=since, force=force))
                done = await asyncio.gather(*passes, return_exceptions=True)
                for outcome in done:
                    if isinstance(outcome, BaseException):
                        raise outcome  # still in the fleet: remove it again, or with unload=False
                gone += [n for names, _ in done for n in names]  # type: ignore[misc]
                if not any(left for _, left in done):  # type: ignore[misc]
                    break
            await asyncio.sleep(0.05)
        async with held(self._lock):
            self._still_in(found)
            self._only(found)
            self.engines.remove(found)
            self._caps.pop(id(found), None)  # ids are reused once the object is gone
            for tenant in self.tenants.values():  # every tenant lets go before the first await: a
                detach(tenant.publisher, found)  # cancel must not leave some still driving it
            for tenant in list(self.tenants.values()):
                if tenant.version is not None and not tenant.retiring:
                    with contextlib.suppress(LoraSyncError):  # best effort, as after every publish
                        await tenant.publisher._care.collect_files(tenant.version)
        return gone

    def _only(self, engine: Engine) -> None:
        if len(self.engines) == 1:
            raise ConfigError(f"{where(engine)} is this fleet's only engine, and a Fleet needs one: add its replacement first (fleet.add_engine(new)), then remove it")

    def _still_in(self, engine: Engine) -> None:
        if not any(e is engine for e in self.engines):
            raise ConfigError(f"{where(engine)} was removed from the fleet meanwhile (by another remove_engine call)")


async def restore_on(tenant: Tenant, engine: Engine, report: FleetReport) -> None:
    """Load ``tenant``'s current version on ``engine`` (just added), at the same version, into
    ``report``. The source is lorasync's own copy (the owned snapshot, else the version's files in
    the store), never the trainer's tensors. The publish is a restore (:func:`republish`): engines
    that list the version already report it ``unchanged`` and nothing is loaded over it there."""
    published = await republish(tenant, report)
    if published is None:
        return
    result = next(r for e, r in zip(tenant.publisher.engines, published.results) if e is engine)
    status = "restored" if published.ok else "failed"
    restored_on = [f"{result.engine} at {result.url or '(in-process)'}"] if result.status == "loaded" else []
    error = next((r.error for r in published.results if not r.ok), None)
    report.tenants[tenant.name] = TenantReport(tenant.name, tenant.registration, status, tenant.version, tenant.served_name, publish=published, error=error, restored_on=restored_on)


def attach(publisher: Publisher, engine: Engine, caps: Capabilities) -> None:
    """``publisher`` drives ``engine`` from now on: a handle (with the fleet's capabilities) and
    an empty ledger, which its first sync fills. Its aftercare reads the same list and dicts."""
    handle = EngineHandle(engine, publisher.name, publisher._files)
    handle._caps = caps
    publisher._handles[id(engine)] = handle
    publisher._ledgers[id(engine)] = Ledger()
    publisher.engines.append(engine)


def detach(publisher: Publisher, engine: Engine) -> None:
    """``publisher`` forgets ``engine``; the versions it held there no longer keep their files."""
    handle, ledger = publisher._handles.pop(id(engine)), publisher._ledgers.pop(id(engine))
    for version in list(ledger.versions):  # left loaded (unload=False): nothing may read them through this fleet
        publisher._files.released(version, handle.engine_id, reloads=handle.reloads)
    publisher.engines.remove(engine)


def _find(engines: list[Engine], engine: Engine | str) -> Engine:
    """The fleet's engine that ``engine`` is: the object, or the URL of the same server (any
    spelling ``refuse_duplicates`` takes for one server)."""
    if isinstance(engine, Engine) and any(e is engine for e in engines):
        return engine
    if isinstance(engine, (Engine, str)):
        url = engine.url if isinstance(engine, Engine) else engine if engine.startswith(("http://", "https://")) else engine.partition(":")[2]
        key = _engine_key(_Named(url)) if url else None
        for candidate in engines:
            if key is not None and key[0] != "object" and _engine_key(candidate) == key:
                return candidate
    listed = ", ".join(where(e) for e in engines)
    raise ConfigError(f"{engine!r} is not one of this fleet's engines ({listed}); pass the engine object, or its URL as the fleet has it")


class _Named:
    """What :func:`_engine_key` reads of an engine: its URL."""

    def __init__(self, url: str) -> None:
        self.url = url
