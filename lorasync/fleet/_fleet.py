"""Fleet: many adapters ("tenants") trained at once, sharing engines (multi-LoRA).

Each tenant is one :class:`~lorasync.Publisher` over the fleet's engine objects (one connection
per endpoint, capabilities probed once), so versions, retention, leases, verification, files and
reports are the publisher's own. The fleet adds what no single publisher can know:

* **Who steps.** A round (:mod:`lorasync.fleet._round`) hashes every adapter passed and
  publishes only tenants whose content changed since their current version; the others are not
  sent and keep their version.
* **One slot budget.** On engines with an adapter limit, :func:`lorasync.fleet._plan.plan_slots`
  plans across tenants before anything moves (current versions, then pinned or in-use ones, then
  windows) and refuses with a ``CapacityError`` before unloading anything.
* **Registrations.** Each ``register`` gets a fresh run in the store (its id): hashes, files and
  reports of a retired registration are never taken for a new one of the same name, and
  ``register`` refuses a name the engines still serve.
* **Recovery.** A tenant whose current version an engine no longer lists (it restarted) is
  loaded there again, same version, from lorasync's own copy of that version: its files in the
  store, or an owned copy in memory where an engine takes tensors.
* **Isolation.** A tenant that fails (bad adapter, failed verification) fails alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from lorasync.fleet._engines import FleetEngines
from lorasync.fleet._plan import FleetReport, SlotNeed, plan_slots
from lorasync.fleet._round import Shared, check_round, publish_round, run_round
from lorasync.runtime._lifecycle import Closing, Lifecycle, async_entry, blocking
from lorasync.runtime._loop import LoopThread, to_thread_untracked
from lorasync.runtime._looplock import LoopLock, held
from lorasync.adapter._names import parse_served_name, served_name, validate_name
from lorasync.adapter._probe import Probe
from lorasync.publisher._publisher import AdapterLike, Publisher
from lorasync.publisher._retention import Retention, check_timeout
from lorasync.publisher._session import aclose_all, refuse_duplicates
from lorasync.engines._engine import Capabilities, Engine
from lorasync.engines._registry import engine_list
from lorasync.fleet._tenant import Tenant, list_all, release, unload_drained, where
from lorasync.errors import ConfigError, LoraSyncError

__all__ = ["Fleet"]


class Fleet(FleetEngines, Closing):
    """Publishes many tenants' adapters to shared engines, one round per training step.

    Args:
        engines: engine clients or specs like ``"vllm:http://127.0.0.1:8000"``; every tenant uses
            these very objects.
        transport (`str`): as for :class:`~lorasync.Publisher` (``"auto"``, ``"disk"``, ``"ipc"``).
        root (`str | os.PathLike`, *optional*): the disk store's root (default per user).

    Raises:
        ConfigError: no engine, one listed twice, or a transport the fleet cannot use.

    Example:
        >>> fleet = Fleet(["vllm:http://127.0.0.1:8000"])  # doctest: +SKIP
        >>> fleet.register("gsm8k", keep=1); fleet.register("dapo", keep=1)  # doctest: +SKIP
        >>> report = fleet.publish({"gsm8k": a1, "dapo": a2}, versions={"gsm8k": 3, "dapo": 3})  # doctest: +SKIP
        >>> report["gsm8k"].served_name  # doctest: +SKIP
        'gsm8k@v3'
    """

    def __init__(self, engines: Iterable[Engine | str] | Engine | str, *, transport: str = "auto", root: str | os.PathLike[str] | None = None) -> None:
        self.engines = engine_list(engines, what="a Fleet")
        refuse_duplicates(self.engines)
        if transport not in ("auto", "disk", "ipc"):
            raise ConfigError(f"a Fleet serves adapters by name: transport must be 'auto', 'disk' or 'ipc', got {transport!r} (merged weights have no room for several tenants)")
        self.transport, self.root = transport, root
        self.tenants: dict[str, Tenant] = {}
        self._shared = Shared(self.tenants, self.engines, self._plan, self._caps_of)  # what a round may use
        self._caps: dict[int, Capabilities] = {}
        self._loop = LoopThread("lorasync-fleet")
        self._lock = LoopLock()
        self._life = Lifecycle(own_loops=lambda: [self._loop.loop, *(e.home_loop() for e in self.engines)], on_fork=self._loop.forget_after_fork)

    # -- tenants ------------------------------------------------------------------------------------

    @blocking("await fleet.aregister(name)")
    def register(self, name: str, *, keep: int = 2, max_staleness: int | None = None, verify: Probe | None = None, grace: float = 1.0, drain_timeout: float | None = 600.0) -> Tenant:
        """Add a tenant. Its versions, window and leases are its own; its slots come from the shared budget.

        Args:
            name (`str`): the adapter name (ASCII letters, digits, ``._-``).
            keep, max_staleness, grace, drain_timeout: its :class:`~lorasync.Retention`.
            verify (`Probe`, *optional*): checked through every engine after each of its loads.

        Returns:
            `Tenant`: the handle, with a ``registration`` id unique to this call.

        Raises:
            ConfigError: the name is registered already, an engine still serves versions of it
                (an earlier registration's or another job's), or a bad option.
            CapacityError: an engine with an adapter limit cannot hold one more current version.
            InvalidNameError: a bad name.
        """

    @async_entry("fleet.aregister()")
    async def aregister(self, name: str, *, keep: int = 2, max_staleness: int | None = None, verify: Probe | None = None, grace: float = 1.0, drain_timeout: float | None = 600.0) -> Tenant:
        """Async twin of :meth:`register`."""
        name = validate_name(name)
        retention = Retention(keep=keep, max_staleness=max_staleness, grace=grace, drain_timeout=drain_timeout, background=False)
        if verify is not None and not isinstance(verify, Probe):
            raise ConfigError(f"verify must be a lorasync.Probe or None, got {type(verify).__name__}")
        async with held(self._lock):
            if name in self.tenants:
                raise ConfigError(f"tenant {name!r} is registered already ({self.tenants[name].registration}); retire it first (fleet.retire({name!r}))")
            listings = await list_all(self.engines)
            for engine, listing in zip(self.engines, listings):
                old = sorted(n for n in listing or () if (parse_served_name(n) or ("",))[0] == name)
                if old:
                    raise ConfigError(
                        f"{where(engine)} still serves {', '.join(old)}: versions of {name!r} that no live registration of this "
                        "fleet owns (an earlier registration, or another job). A new registration must not be mistaken for them: "
                        "unload them from the engine, or register under another name"
                    )
            await self._plan(listings, {}, newcomer=name, dry_run=True)
            publisher = Publisher(self.engines, name=name, transport=self.transport, root=self.root, verify=verify, retention=retention)
            publisher._room_planned = True  # the round's plan made room (self._plan): a previous version with a slot serves on
            for engine in self.engines:  # capabilities: probed once per engine, shared by every tenant
                publisher._handles[id(engine)]._caps = await self._caps_of(engine)
            tenant = self.tenants[name] = Tenant(name, publisher)
            return tenant

    @blocking("await fleet.aretire(name)")
    def retire(self, name: str, *, timeout: float | None = None) -> list[str]:
        """End a tenant: unload every version of it on every engine once its requests drained,
        then delete its files. The name may then be registered again (a new registration). A
        version unloaded at the timeout that an engine still re-reads for a running request (vLLM)
        keeps its files, and with them its run, until this process ends (as retention keeps them).

        Args:
            name (`str`): the tenant.
            timeout (`float`, *optional*): seconds to wait for requests on its versions
                (default its ``drain_timeout``); then they are unloaded anyway (``RetentionWarning``).

        Returns:
            The served names unloaded.

        Raises:
            ConfigError: no tenant of that name. EngineError: an engine failed (the tenant stays
                registered: call ``retire`` again).
        """

    @async_entry("fleet.aretire()")
    async def aretire(self, name: str, *, timeout: float | None = None) -> list[str]:
        """Async twin of :meth:`retire`. Other tenants' rounds go on while it waits for requests."""
        check_timeout(timeout)
        async with held(self._lock):
            tenant = self._tenant(name)
            tenant.retiring = True
        pub, since, gone, committed = tenant.publisher, time.monotonic(), [], False
        limit = timeout if timeout is not None else pub.retention.drain_timeout
        try:
            while True:
                async with held(self._lock):  # one pass at a time, never while a round plans or loads
                    force = limit is not None and time.monotonic() - since >= limit
                    done = await asyncio.gather(*(unload_drained(tenant, e, since=since, force=force) for e in self.engines), return_exceptions=True)
                    for outcome in done:
                        if isinstance(outcome, BaseException):
                            raise outcome
                    gone += [n for names, _ in done for n in names]  # type: ignore[misc]
                    if not any(left for _, left in done):  # type: ignore[misc]
                        committed = True  # files go from here: a cancel leaves it retiring (retire again ends it)
                        await release(tenant, self.engines)
                        del self.tenants[tenant.name]
                        return gone
                await asyncio.sleep(0.05)
        except BaseException:
            if not committed:
                # Failed or cancelled while draining: still registered, and served again where a
                # pass unloaded it (the next round restores it there); retire again to end it.
                tenant.retiring = False
            raise

    # -- rounds ---------------------------------------------------------------------------------------

    @blocking("await fleet.apublish(adapters, versions=...)")
    def publish(self, adapters: Mapping[str, AdapterLike], *, versions: Mapping[str, int], verify: Mapping[str, Probe] | None = None) -> FleetReport:
        """One round: publish the tenants whose content changed, restore what engines lost.

        Args:
            adapters: ``{tenant: adapter}`` (an ``Adapter``, or a PEFT model / state dict). Every
                one is hashed, every byte, to learn whether it changed; a trainer that knows
                which tenants stepped may pass only those (the others keep their versions).
            versions: ``{tenant: version}`` for every tenant in ``adapters`` (e.g. its step);
                a tenant whose content did not change keeps its current version whatever is given.
            verify: ``{tenant: Probe}`` overriding a tenant's probe for this round.

        Returns:
            `FleetReport`: a ``TenantReport`` per tenant that was published, unchanged, restored
            or failed, each with one ``EngineResult`` per engine. Tenant failures are reported,
            not raised (``report.raise_for_errors()`` raises them).

        Raises:
            ConfigError: an unknown tenant or a missing version.
            CapacityError: an engine's slots cannot hold every tenant's current and in-use
                versions; nothing was unloaded or loaded.
        """

    @async_entry("fleet.apublish()")
    async def apublish(self, adapters: Mapping[str, AdapterLike], *, versions: Mapping[str, int], verify: Mapping[str, Probe] | None = None) -> FleetReport:
        """Async twin of :meth:`publish`."""
        report = FleetReport()
        async with held(self._lock):
            # Under the lock: a retirement may have begun or ended meanwhile.
            versions = check_round(adapters, versions, verify, known=self._publishable)
            await publish_round(self._shared, report, adapters, versions, verify or {})
        return report

    @blocking("await fleet.arestore()")
    def restore(self) -> FleetReport:
        """Load every tenant's current version again on engines that lost it (restarted, or
        added), versions unchanged. Publishing does this too, in each round.

        Returns:
            `FleetReport`: restored (or failed) tenants; ``report.restored`` lists them.

        Raises:
            CapacityError: the engines' slots cannot hold every current version.
        """

    @async_entry("fleet.arestore()")
    async def arestore(self) -> FleetReport:
        """Async twin of :meth:`restore`."""
        report = FleetReport()
        async with held(self._lock):
            await run_round(self._shared, report, {}, {})
        return report

    async def _plan(self, listings: list[list[str] | None], stepping: Mapping[str, int], *, newcomer: str | None = None, dry_run: bool = False) -> list[str]:
        """The shared budget on every engine with an adapter limit; unload what does not fit.

        Raises:
            CapacityError: current and in-use versions do not fit (nothing unloaded)."""
        drops: list[tuple[Engine, str, int]] = []
        for engine, listing in zip(self.engines, listings):
            if listing is None:
                continue  # unreachable: its loads fail per tenant, in the reports
            busy: frozenset[str] = frozenset()
            caps = await self._caps_of(engine)
            if caps.max_loras is None:
                continue
            with contextlib.suppress(LoraSyncError):  # an engine that cannot tell: pins alone are held
                busy = await engine.aadapters_in_use() or frozenset()
            needs = [SlotNeed(newcomer, None, first=True)] if newcomer is not None else []
            for name, tenant in self.tenants.items():
                loaded = sorted(v for n in listing if (p := parse_served_name(n)) is not None and p[0] == name for v in [p[1]])
                current = None if tenant.retiring else stepping.get(name, tenant.version)
                pins = tenant.publisher.pinned
                after = sorted(set(loaded) | ({current} if current is not None else set()))
                window = tenant.publisher.retention.window(after, pins)
                held_now = frozenset(pins | {v for v in loaded if served_name(name, v) in busy})
                if caps.reloads_from_path and not tenant.retiring and tenant.version in loaded:  # it serves until its successor does
                    held_now |= {tenant.version}  # (rollouts lease it till then); the publish retires it after
                needs.append(SlotNeed(name, current, tuple(loaded), held_now, frozenset(window), first=not tenant.retiring))
            foreign = [n for n in listing if (parse_served_name(n) or ("",))[0] not in self.tenants]
            for name, version in plan_slots(needs, capacity=caps.max_loras, foreign=foreign, where=where(engine), soft=caps.reloads_from_path, engine=engine.kind, url=engine.url):
                drops.append((engine, name, version))
        gone: list[str] = []
        for engine, name, version in drops if not dry_run else ():
            pub = self.tenants[name].publisher
            handle, ledger = pub._handles[id(engine)], pub._ledgers[id(engine)]
            ledger.synced = False
            await handle.sync(ledger)
            gone += await handle.unload(ledger, [version])
        return gone

    async def _caps_of(self, engine: Engine) -> Capabilities:
        if id(engine) not in self._caps:
            self._caps[id(engine)] = await engine.acapabilities()
            for tenant in self.tenants.values():
                tenant.publisher._handles[id(engine)]._caps = self._caps[id(engine)]
        return self._caps[id(engine)]

    def _publishable(self, name: str) -> Tenant:
        tenant = self._tenant(name)
        if tenant.retiring:
            raise ConfigError(f"tenant {name!r} is retiring: publish nothing more to it (register the name again once retired)")
        return tenant

    def _tenant(self, name: str) -> Tenant:
        if (tenant := self.tenants.get(name) if isinstance(name, str) else None) is None:
            raise ConfigError(f"no tenant {name!r} in this fleet (registered: {', '.join(sorted(self.tenants)) or 'none'}); fleet.register({name!r}) first")
        return tenant

    # -- lifecycle ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Retire what each tenant's window let go of, release every tenant's run and close the
        engines' connections. Loaded current versions stay loaded. Idempotent.

        Raises:
            BlockingCallError: in async code on the fleet's loop (use :meth:`aclose`).
        """
        if self._life.open:
            self._life.check_sync("close()", "await fleet.aclose()")
        if not self._life.begin_close():
            return
        try:
            self._lock.refuse(lambda: self._life.closed_error("a call waiting for the fleet"))
            with contextlib.suppress(LoraSyncError):
                self._loop.run(self._close_out())
                self._loop.run(aclose_all(self.engines))
        finally:
            self._loop.stop()
            for engine in self.engines:
                engine.close()
            self._life.closed()

    async def aclose(self) -> None:
        """Async twin of :meth:`close`."""
        if not self._life.begin_close():
            return
        try:
            self._lock.refuse(lambda: self._life.closed_error("a call waiting for the fleet"))
            with contextlib.suppress(LoraSyncError):
                await self._close_out()
        finally:
            await aclose_all(self.engines)
            if self._loop.running:
                with contextlib.suppress(LoraSyncError):
                    await self._loop.arun(aclose_all(self.engines))
            await to_thread_untracked(self._loop.stop)
            self._life.closed()

    async def _close_out(self) -> None:
        async with held(self._lock, closer=True):
            for tenant in self.tenants.values():
                with contextlib.suppress(LoraSyncError):
                    await tenant.publisher._close_out()
                tenant.publisher._release()

