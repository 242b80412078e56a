"""A fleet's tenant: one registration of a name (its handle, the :class:`~lorasync.Publisher`
that does its work), and the parts of :class:`~lorasync.Fleet` that act on one tenant: draining it
out of an engine on retirement, and what a restore loads (lorasync's own copy of the current
version, never the trainer's tensors, design invariant 7): the version's files in the store where
every engine loads files, else an owned copy in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import warnings
from collections.abc import Iterator, Sequence

from lorasync.adapter._adapter import Adapter
from lorasync.publisher._digest import PublishDigest
from lorasync.publisher._handle import EngineHandle
from lorasync.fleet._hash import Gate, content_hash
from lorasync.fleet._plan import FleetReport, TenantReport
from lorasync.adapter._names import parse_served_name, served_name, validate_version
from lorasync.adapter._probe import Probe
from lorasync.publisher._publisher import Publisher
from lorasync.publisher._report import PublishReport
from lorasync.publisher._retention import RetentionWarning
from lorasync.engines._engine import Capabilities, Engine
from lorasync.errors import ConfigError, LoraSyncError, PublisherClosedError
from lorasync.transports._snapshot import OwnedAdapter, owned_copy
from lorasync.runtime._loop import to_thread_untracked

__all__ = ["Tenant", "files_only", "from_files", "list_all", "release", "republish", "restore", "restore_copy", "step", "unload_drained", "where"]


class Tenant:
    """One registration of a name in a :class:`Fleet` (what :meth:`Fleet.register` returns).

    Attributes:
        name (`str`): the tenant's name; engines serve version N as ``name@vN``.
        registration (`str`): unique per ``register`` call (the run of its files in the store).
        version (`int | None`): the version it serves now (None before its first publish).
        retired (`bool`): :meth:`Fleet.retire` ended this registration.
    """

    def __init__(self, name: str, publisher: Publisher) -> None:
        self.name = name
        self.registration = publisher.run
        self.publisher = publisher
        publisher._on_served = self._serves
        self.version: int | None = None
        self.content_hash: str | None = None
        self.retired = False
        self.retiring = False  # Fleet.retire runs: no new leases, running ones drain
        # The current version, owned, when an engine takes tensors (restores load it); None when
        # every engine loads files: the version's directory in the store is the owned copy then.
        self._copy: OwnedAdapter | None = None
        self._stepping: tuple[int, Adapter, bool, Probe | None] | None = None  # the round's publish in flight: version, adapter, owned, probe
        # The round's probe its current version was verified with (None: the registration's own,
        # which the publisher applies anyway): every later load of that version, a restore on an
        # engine that lost it or never verified it, is checked against it too (only a verified
        # version counts as served).
        self._probe: Probe | None = None

    def _serves(self, version: int, served: str, digest: str) -> None:
        """The publisher's word that every engine serves ``version`` now (content ``digest``),
        given before it retires the previous one: rollouts that lease ``tenant.version`` from here
        on get the new version, never one being retired. The version moves together with what a
        restore loads and the hash: a round cancelled after this point (while the previous version
        retires) must leave a tenant whose restores load that version's content, never the
        previous one's under the new name."""
        stepping = self._stepping
        if served != served_name(self.name, version) or (self.version is not None and version <= self.version):
            return
        if stepping is None or stepping[0] != version:
            return  # not the round's publish: the round sets the tenant itself
        _, adapter, owned, probe = stepping
        # Not owned: the trainer's tensors, never kept; until step() decides (restore_copy), a
        # restore reads the version's files, checked against the recorded hash.
        self.version, self.content_hash, self._probe = version, digest, probe
        self._copy = adapter if owned else None  # type: ignore[assignment]

    @property
    def served_name(self) -> str:
        """``name@v<version>`` (empty before the first publish)."""
        return served_name(self.name, self.version) if self.version is not None else ""

    def _live(self, call: str) -> Publisher:
        if self.retired or self.retiring:
            raise PublisherClosedError(f"{call}: tenant {self.name!r} (registration {self.registration}) was retired{'' if self.retired else ' (it is retiring)'}; register the name again for a new one")
        return self.publisher

    def pin(self, version: int) -> None:
        """Never retire ``version`` of this tenant until :meth:`unpin` (see ``Publisher.pin``)."""
        self._live("pin()")._add_pin(validate_version(version))

    def unpin(self, version: int) -> None:
        """Undo one :meth:`pin`."""
        self.publisher._drop_pin(validate_version(version))

    @contextlib.contextmanager
    def lease(self, version: int | None = None) -> Iterator[str]:
        """Pin ``version`` for the ``with`` block; yields its served name.

        Args:
            version (`int`, *optional*): the version to pin; by default the current one, pinned
                so that it cannot be on its way out: ``tenant.lease(tenant.version)`` reads the
                version before it pins it, and a round between the two may already be retiring it.

        Raises:
            PublisherClosedError: the tenant is retired or retiring.
            ConfigError: no version yet (the tenant was never published).
            VerificationError: the version's last publish failed its verification, so it is not
                served (as ``Publisher.lease`` refuses it).
        """
        held = self._pin_current() if version is None else self._hold(version)
        try:
            yield served_name(self.name, held)
        finally:
            self.unpin(held)

    def _hold(self, version: int) -> int:
        # One path for every lease, the publisher's: it refuses a version that failed its
        # verification (issue 33) and pins the version that serves it.
        return self._live("lease()")._hold(version)

    def _pin_current(self) -> int:
        # The pin comes first, then the check: a round moves ``version`` before it retires the
        # previous one (_serves), so a version still current after being pinned is not being
        # retired, and its retirement will see the pin.
        while True:
            version = self.version
            if version is None:
                self._live("lease()")
                raise ConfigError(f"tenant {self.name!r} has no version yet: lease one after its first publish")
            held = self._hold(version)
            if self.version == version:
                return held
            self.unpin(held)

    def __repr__(self) -> str:
        return f"Tenant({self.name!r}, registration={self.registration!r}, version={self.version}{', retired' if self.retired else ''})"


async def unload_drained(tenant: Tenant, engine: Engine, *, since: float, force: bool) -> tuple[list[str], bool]:
    """One pass of a retirement on ``engine``: unload the tenant's versions whose requests and
    leases drained (all of them with ``force``, with a ``RetentionWarning``), as retention does.
    An engine that cannot report requests gets the grace period from ``since`` (monotonic).

    Returns:
        The served names unloaded, and whether versions are left.
    """
    pub = tenant.publisher
    handle, ledger = pub._handles[id(engine)], pub._ledgers[id(engine)]
    ledger.synced = False
    await handle.sync(ledger)
    if not ledger.versions:
        return [], False
    busy = await handle.in_use()
    leased = pub.pinned  # leases taken before the retirement began drain like requests
    waiting = busy is None and not handle.drains and time.monotonic() - since < pub.retention.grace
    free = [] if waiting else [v for v in ledger.versions if v not in leased and (busy is None or served_name(tenant.name, v) not in busy)]
    forced: list[int] = []
    if force and len(free) < len(ledger.versions):
        forced = [v for v in ledger.versions if v not in free]
        free = list(ledger.versions)
        warnings.warn(f"retiring {tenant.name}: {', '.join(served_name(tenant.name, v) for v in free)} on {where(engine)} unloaded although requests or leases still used them (timeout)", RetentionWarning, stacklevel=3)
    gone = await handle.unload(ledger, free, forced=forced)
    return gone, bool(ledger.versions)


async def release(tenant: Tenant, engines: Sequence[Engine]) -> None:
    """The end of a retirement: the registration's files (after the grace on engines that may
    re-read them for a request they admitted), its run (folder and owner lock: every register /
    retire cycle gives back what it took) and loop. The engines stay open.

    A version that an engine which re-reads files still reports requests on (unloaded by force at
    the timeout) or still holds keeps its files, as retention keeps them: with them the run and
    its lock stay until this process ends, and a later publisher's sweep collects them then."""
    pub = tenant.publisher
    await pub._disk.settle()  # a round cancelled mid-write: that write ends before the run goes
    readers = [pub._handles[id(e)] for e in engines if pub._handles[id(e)].reloads]
    still: set[str] = set()
    if readers:
        await asyncio.sleep(pub.retention.grace)
        for handle in readers:  # None (requests unknown): the grace above was the fallback
            still |= set(await handle.in_use() or ()) | handle.leaks.suspects | await _listed(handle)
    for version in await to_thread_untracked(pub.store.versions, tenant.name):
        if served_name(tenant.name, version) in still:
            continue
        with contextlib.suppress(LoraSyncError):
            await to_thread_untracked(pub.store.remove, tenant.name, version)
    with contextlib.suppress(LoraSyncError):  # what could not be removed keeps the run (and its lock)
        await to_thread_untracked(pub.store.end_run, tenant.name)
    pub._release()
    tenant.retired = True


async def _listed(handle: EngineHandle) -> set[str]:
    """What the handle's engine still lists (an unload that answered may have kept it), judged as
    retired names are; everything of the tenant when the engine cannot say."""
    try:
        listed = await handle.engine.alist_adapters()
    except LoraSyncError:
        return {served_name(handle.name, v) for v in await to_thread_untracked(handle.files.store.versions, handle.name)}
    await handle.leaks.check(listed=listed, busy=handle.last_in_use)  # a name it kept is reported (SlotLeakWarning)
    return set(listed)


async def list_all(engines: Sequence[Engine]) -> list[list[str] | None]:
    """What each engine serves now, listed once per round (None: it did not answer; its loads
    then fail per tenant, in the reports)."""
    got = await asyncio.gather(*(e.alist_adapters() for e in engines), return_exceptions=True)
    for g in got:
        if isinstance(g, BaseException) and not isinstance(g, LoraSyncError):
            raise g
    return [None if isinstance(g, LoraSyncError) else g for g in got]  # type: ignore[misc]


def files_only(publisher: Publisher, caps: Sequence[Capabilities]) -> bool:
    """Whether ``publisher`` hands every engine (by ``caps``) its versions as files, as
    :func:`~lorasync.publisher._select.choose_transport` decides: then each version's directory in the
    store is lorasync's own copy of it, and a round needs no copy in memory."""
    disk, ipc = publisher._candidates["disk"], publisher._candidates["ipc"]
    if publisher.transport == "disk":
        return True
    if publisher.transport != "auto" or disk is None:
        return False
    for c in caps:
        takes_tensors = ipc is not None and ipc.unsupported(c) is None
        if disk.unsupported(c) is not None or (c.in_process and takes_tensors):
            return False
    return True


async def step(tenant: Tenant, report: FleetReport, adapter: Adapter, version: int, probe: Probe | None, *, owned: bool, digest: PublishDigest | None = None, gate: Gate | None = None) -> None:
    """Publish a changed tenant's new version, into ``report``: an owned copy (``owned``), or the
    trainer's adapter when every engine loads files, whose version directory is then what a
    restore loads. ``digest``: the publish's view of ``adapter`` the round began (its hash and
    torn-read watch). ``gate`` (held for this tenant) is released once the publish hands the
    adapter to the engines, or ends."""
    once = [gate]

    def staged() -> None:
        if once[0] is not None:
            once.pop().release()  # type: ignore[union-attr]
            once.append(None)

    tenant.publisher._on_staged = staged
    tenant._stepping = (version, adapter, owned, probe)  # what Tenant._serves moves the tenant to once served
    try:
        published = await tenant.publisher._apublish(adapter, version=version, verify=probe, digest=digest)
    except LoraSyncError as exc:
        report.tenants[tenant.name] = TenantReport(tenant.name, tenant.registration, "failed", tenant.version, tenant.served_name, error=exc)
        return
    finally:
        tenant.publisher._on_staged = None
        tenant._stepping = None
        staged()
    same = version == tenant.version and published.content_hash == tenant.content_hash  # its current version, checked again
    # The tenant moves to ``version`` only where an engine loaded it. A publish whose every engine
    # answered "unchanged" found the engines serving these bytes already, under the version they
    # serve (the trainer stepped away and back, a cancelled round's load landed, a GPU adapter's
    # device hash never equals the files' hash): that version stays the tenant's, and no name is
    # reported that no engine serves. Engines that failed get it on the next round (restore).
    if any(r.ok and r.status == "loaded" for r in published.results) and not same:
        tenant.version, tenant.content_hash, tenant._probe = version, published.content_hash, probe
        tenant._copy = adapter if owned else await restore_copy(adapter, published)  # type: ignore[assignment]
    elif published.ok and published.content_hash != tenant.content_hash and (served := _served_as(published, tenant.name)) is not None:
        # Engines serve these new bytes already, under a version after the tenant's own (a load
        # whose round was cancelled after it landed): that version becomes the tenant's.
        if tenant.version is None or served > tenant.version:
            tenant.version, tenant.content_hash, tenant._probe = served, published.content_hash, probe
            tenant._copy = adapter if owned else await restore_copy(adapter, published)  # type: ignore[assignment]
    failed = next((r.error for r in published.results if not r.ok), None)
    status = "failed" if not published.ok else "unchanged" if all(r.status == "unchanged" for r in published.results) else "loaded"
    report.tenants[tenant.name] = TenantReport(tenant.name, tenant.registration, status, tenant.version, tenant.served_name, publish=published, error=failed)


def _served_as(published: PublishReport, name: str) -> int | None:
    """The one version every engine of an all-"unchanged" publish serves its bytes under (None:
    some engine loaded or failed, or they disagree)."""
    found = {parse_served_name(r.served_name) for r in published.results}
    if not published.results or any(r.status != "unchanged" for r in published.results) or len(found) != 1:
        return None
    only = found.pop()
    return only[1] if only is not None and only[0] == name else None


async def restore(tenant: Tenant, report: FleetReport) -> None:
    """Load the tenant's current version again where an engine lost it, into ``report``: from
    its owned copy, or from its files (:func:`from_files`)."""
    published = await republish(tenant, report)
    if published is None:
        return
    again = [f"{r.engine} at {r.url or '(in-process)'}" for r in published.results if r.status == "loaded"]
    failed = next((r.error for r in published.results if not r.ok), None)
    previous = report.tenants.get(tenant.name)
    report.tenants[tenant.name] = TenantReport(
        tenant.name, tenant.registration, "restored" if published.ok and (previous is None or previous.ok) else "failed", tenant.version, tenant.served_name,
        publish=published, error=failed if failed is not None else (previous.error if previous else None), restored_on=again,
    )


async def republish(tenant: Tenant, report: FleetReport) -> PublishReport | None:
    """Publish the tenant's current version again, at that version, from lorasync's own copy of
    it (the owned snapshot, else its files: :func:`from_files`), never the trainer's tensors.
    Engines that list it already report it ``unchanged`` and move nothing (one whose content of it
    cannot be known, as after an SGLang tensor load, is left as it is); every engine it loads
    on is checked against the probe the version was published with (a restore never serves a
    version unverified, nor one that failed its probe there). Returns the publish
    report, or None when it failed outright (then ``report`` says so for the tenant)."""
    assert tenant.version is not None
    try:
        source = tenant._copy if tenant._copy is not None else await to_thread_untracked(from_files, tenant)
        return await tenant.publisher._apublish(source, version=tenant.version, verify=tenant._probe, restore=True)
    except LoraSyncError as exc:
        report.tenants[tenant.name] = TenantReport(tenant.name, tenant.registration, "failed", tenant.version, tenant.served_name, error=exc)
        return None


async def restore_copy(adapter: Adapter, published: PublishReport) -> OwnedAdapter | None:
    """What a restore loads for a version published from the trainer's own tensors: None when
    every engine got it as files (a restore reads the version's directory, see
    :func:`from_files`); otherwise an owned copy taken now, while the publish call still holds
    the trainer, and kept only if it hashes to what was published."""
    if all(r.transport == "disk" for r in published.results if r.ok):
        return None
    copy = await to_thread_untracked(owned_copy, adapter)
    return copy if await to_thread_untracked(content_hash, copy) == published.content_hash else None


def from_files(tenant: Tenant) -> Adapter:
    """The tenant's current version read back from its directory in the store (the publisher
    checks it against the recorded hash before anything is loaded).

    Raises:
        StorageError: the files are gone (an engine that lost the version is then reported failed).
    """
    assert tenant.version is not None
    return Adapter.load(tenant.publisher.store.path_for(tenant.name, tenant.version))


def where(engine: Engine) -> str:
    return f"{engine.kind} at {engine.url or '(in-process)'}"
