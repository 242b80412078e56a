"""One :class:`~lorasync.Fleet` round: hash every adapter passed, plan the shared slots, publish
the tenants that changed and restore what engines lost.

Without an adapter limit on any engine there is nothing to plan across tenants, so a changed
tenant's publish starts as soon as its hash is known while the others are still hashed (in
threads, :mod:`lorasync.fleet._hash`), and that hashing waits while the publish writes its
version: what overlaps is the engine's load. With a limit, every hash is known before the plan
(it needs every stepping tenant), and the publishes start after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lorasync.adapter._adapter import Adapter
from lorasync.publisher._digest import PublishDigest
from lorasync.fleet._hash import Gate, HashJob, scan
from lorasync.fleet._plan import FleetReport, TenantReport
from lorasync.adapter._names import validate_version
from lorasync.adapter._probe import Probe
from lorasync.publisher._publisher import AdapterLike
from lorasync.fleet._tenant import files_only, list_all, restore, step
from lorasync.errors import ConfigError, LoraSyncError, StaleVersionError
from lorasync.runtime._loop import to_thread_untracked

if TYPE_CHECKING:
    from lorasync.engines._engine import Capabilities, Engine
    from lorasync.fleet._tenant import Tenant

__all__ = ["Shared", "by_files", "check_round", "limited", "publish_round", "run_round"]


@dataclass(frozen=True)
class Shared:
    """What a round needs of the Fleet that runs it, and nothing more: a Fleet calls rounds, a
    round never reaches back into the Fleet.

    Attributes:
        tenants: the Fleet's tenants by name (the live mapping: registrations show at once).
        engines: the Fleet's engines (the live list: added and removed engines show at once).
        plan: plans the shared slots for the tenants stepping, ``plan(listings, {name: version})``,
            unloading what must go; returns the served names unloaded.
        caps_of: an engine's capabilities (asked once, then remembered by the Fleet).
    """

    tenants: Mapping[str, Tenant]
    engines: Sequence[Engine]
    plan: Callable[[list[list[str] | None], Mapping[str, int]], Awaitable[list[str]]]
    caps_of: Callable[[Engine], Awaitable[Capabilities]]


def check_round(adapters: object, versions: object, verify: object, *, known: Callable[[str], object]) -> dict[str, int]:
    """Refuse a round's arguments before anything is hashed, sent or loaded (every surface that
    takes a round checks them here: ``Fleet.publish``, ``DistributedFleet.publish``).

    Args:
        known: raises for a name that is no live tenant (``ConfigError``).

    Returns:
        ``{tenant: version}`` for every tenant in ``adapters``, validated.

    Raises:
        ConfigError: ``adapters``, ``versions`` or ``verify`` is not a mapping of the kind named,
            a tenant is unknown or has no version, or ``verify`` names a tenant not in ``adapters``.
            A single ``Probe`` is refused: each probe records one adapter's outputs, so a round
            takes one per tenant (``verify={name: probe}``).
        InvalidNameError: a version that is not an int >= 0.
    """
    if not isinstance(adapters, Mapping):
        raise ConfigError(f"adapters must be a mapping {{tenant: adapter}} (an Adapter, a PEFT model or a state dict each), got {type(adapters).__name__}")
    if not isinstance(versions, Mapping):
        raise ConfigError(f"versions must be a mapping {{tenant: version}} with a version for every adapter, e.g. versions={{name: step for name in adapters}}; got {type(versions).__name__}")
    if isinstance(verify, Probe):
        raise ConfigError(
            "verify= takes one Probe per tenant, verify={name: probe, ...}: a Probe records one adapter's outputs, so one "
            "Probe cannot check every tenant of a round (a tenant's default probe is given at fleet.register(name, verify=probe))"
        )
    if verify is not None and not isinstance(verify, Mapping):
        raise ConfigError(f"verify must be a mapping {{tenant: Probe}} or None, got {type(verify).__name__}")
    checked: dict[str, int] = {}
    for name in adapters:
        known(name)
        if name not in versions:
            raise ConfigError(f"no version for tenant {name!r}: pass versions={{{name!r}: step, ...}} for every adapter")
        checked[name] = validate_version(versions[name])
    for name, probe in (verify or {}).items():
        if name not in adapters:
            raise ConfigError(f"verify={{{name!r}: ...}} names no tenant of this round's adapters ({', '.join(map(repr, adapters)) or 'none'}); pass a probe only with its tenant's adapter")
        if not isinstance(probe, Probe):
            raise ConfigError(f"verify={{{name!r}: ...}} must be a lorasync.Probe (Probe.from_model(...)), got {type(probe).__name__}")
    return checked


async def publish_round(fleet: Shared, report: FleetReport, adapters: Mapping[str, AdapterLike], versions: Mapping[str, int], probes: Mapping[str, Probe]) -> None:
    """Hash every adapter passed (in threads); publish the changed ones, restore what engines lost.

    Without an adapter limit on any engine there is nothing to plan across tenants, so a
    changed tenant's publish starts as soon as its hash is known, while the others are still
    hashed. With one, every hash is known first: the plan needs every stepping tenant."""
    early = not await limited(fleet)
    copy = not await by_files(fleet)
    stepping: dict[str, tuple[Adapter, int, bool, PublishDigest | None]] = {}
    started: list[asyncio.Future[None]] = []
    unexpected: list[BaseException] = []
    gate = Gate() if early else None

    def changed(name: str, adapter: Adapter | None, digest: PublishDigest | None, error: BaseException | None) -> None:
        # A loop callback: whatever goes wrong here must reach the round (never the loop's
        # exception handler), and the gate a worker held for this tenant must be released, or
        # the other workers and the round wait for ever.
        try:
            tenant = fleet.tenants[name]
            if error is not None:
                raise error
            version = validate_version(versions[name])
            if tenant.version is not None and version <= tenant.version:
                raise StaleVersionError(f"{name} v{version} would replace v{tenant.version} with other content; versions must increase. Nothing was sent.", adapter=name, version=version, newest=tenant.version)
            assert adapter is not None
            stepping[name] = (adapter, version, copy, digest)
            if early:
                started.append(asyncio.ensure_future(step(tenant, report, adapter, version, probes.get(name), owned=copy, digest=digest, gate=gate)))
        except BaseException as exc:  # noqa: BLE001 - raised by the round once its publishes ended
            if gate is not None and adapter is not None and name not in stepping:
                gate.release()  # the worker held it for this tenant, which publishes nothing
            if not isinstance(exc, LoraSyncError) or name not in fleet.tenants:
                unexpected.append(exc)
                return
            tenant = fleet.tenants[name]
            report.tenants[name] = TenantReport(name, tenant.registration, "failed", tenant.version, tenant.served_name, error=exc)  # this tenant alone

    jobs = [HashJob(name, adapter, fleet.tenants[name].content_hash, copy) for name, adapter in adapters.items()]
    try:
        same = await scan(jobs, changed, gate=gate)
        # An unchanged tenant given a probe this round goes through its publisher at its current
        # version: "unchanged" is the publisher's word, after its verification (nothing moves).
        for name in [n for n in same if n in probes]:
            same.remove(name)
            tenant = fleet.tenants[name]
            adapter = adapters[name] if isinstance(adapters[name], Adapter) else await to_thread_untracked(_export, adapters[name])
            stepping[name] = (adapter, tenant.version, False, None)  # type: ignore[assignment]
            if early:
                started.append(asyncio.ensure_future(step(tenant, report, adapter, tenant.version, probes[name], owned=False)))  # type: ignore[arg-type]
        # The tenants settled by their hash come first, in the caller's order, as in a round
        # that hashed one tenant after the other (raise_for_errors raises the first failure).
        settled = {}
        for name in adapters:
            tenant = fleet.tenants[name]
            if name in same:
                settled[name] = TenantReport(name, tenant.registration, "unchanged", tenant.version, tenant.served_name)
            elif name not in stepping and name in report.tenants:
                settled[name] = report.tenants[name]
        report.tenants = settled | {n: t for n, t in report.tenants.items() if n not in settled}
        await run_round(fleet, report, {} if early else stepping, probes, started=started, skip=stepping)
    except BaseException:
        for task in started:
            task.cancel()
        await asyncio.gather(*started, return_exceptions=True)
        raise
    finally:
        if gate is not None:
            gate.open()
    if unexpected:
        raise unexpected[0]


def _export(model: object) -> Adapter:
    from lorasync.exporters.fsdp import export

    return export(model)  # type: ignore[arg-type]


async def run_round(fleet: Shared, report: FleetReport, stepping: Mapping[str, tuple[Adapter, int, bool, PublishDigest | None]], probes: Mapping[str, Probe], *, started: Sequence[asyncio.Future[None]] = (), skip: Iterable[str] = ()) -> None:
    """Plan for ``stepping`` and publish it; restore the tenants, not stepping nor in
    ``skip``, that an engine lost; wait for ``started`` publishes too."""
    listings = await list_all(fleet.engines)
    skip = set(skip) | set(stepping)
    lost = {
        name for name, t in fleet.tenants.items()
        if name not in skip and t.version is not None and not t.retiring and any(ls is not None and t.served_name not in ls for ls in listings)
    }
    report.unloaded = await fleet.plan(listings, {n: v for n, (_, v, _, _) in stepping.items()})
    jobs = [step(fleet.tenants[n], report, adapter, v, probes.get(n), owned=owned, digest=digest) for n, (adapter, v, owned, digest) in stepping.items()]
    jobs += [restore(fleet.tenants[n], report) for n in sorted(lost)]
    await asyncio.gather(*started, *jobs)


async def limited(fleet: Shared) -> bool:
    """Whether an engine has an adapter limit (or cannot say): then a round plans first."""
    for engine in fleet.engines:
        try:
            if (await fleet.caps_of(engine)).max_loras is not None:
                return True
        except LoraSyncError:
            return True
    return False

async def by_files(fleet: Shared) -> bool:
    """Whether every engine loads versions from the store's files (then those files, not an
    owned copy in memory, are what a restore loads)."""
    try:
        caps = [await fleet.caps_of(e) for e in fleet.engines]
    except LoraSyncError:
        return False
    return bool(fleet.tenants) and files_only(next(iter(fleet.tenants.values())).publisher, caps)
