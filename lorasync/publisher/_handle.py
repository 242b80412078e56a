"""EngineHandle: the publisher's side of one engine — capabilities, the version ledger's sync with
the engine, capacity, verification, settling after a load and unloading retired versions.

The publisher owns one handle per engine and calls it under its lock; the decisions of what to
retire are :func:`lorasync.publisher._retention.plan`'s, the files' fate is :class:`lorasync.publisher._files.VersionFiles`'.

A content hash is reused only under the same identity (design invariant 8): :meth:`EngineHandle.sync`
keeps, for each version the engine lists, a hash only while the engine still serves the very load it
was taken of. Where the engine names the source of each adapter (``Engine.adapter_sources``: vLLM,
SGLang, the PEFT engine, Ray actors hosting them), that is checked: the hash this publisher
remembered for the source it loaded, or the hash recorded with the very directory the engine names.
An engine that cannot name sources is trusted only in this process (nothing outside it can reload an
in-process engine); a remote one then keeps no hash past the load itself, so identical content is
published again rather than reported as served on memory alone.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping
from typing import Any

from lorasync.adapter._adapter import Adapter
from lorasync.publisher._cancelled import CancelledCalls
from lorasync.publisher._capacity import plan_room
from lorasync.publisher._files import VersionFiles
from lorasync.publisher._leaks import SlotLeaks
from lorasync.adapter._names import parse_served_name, served_name
from lorasync.adapter._probe import Probe, run_probe
from lorasync.publisher._retention import LEARN, Ledger, Retention, RetentionWarning, plan
from lorasync.engines._engine import Capabilities, Engine, is_in_process_id
from lorasync.errors import AdapterNotFoundError, EngineError, EngineUnavailableError, StaleVersionError, UnverifiedUnreachableError, VerificationError
from lorasync.transports._transport import Transport
from lorasync.transports.inplace import InPlaceTransport
from lorasync.transports._snapshot import OwnedAdapter, owned_copy
from lorasync.transports.merged import MergedTransport
from lorasync.runtime._loop import to_thread_untracked

__all__ = ["EngineHandle"]

log = logging.getLogger("lorasync.publish")


class EngineHandle:
    """One engine as one publisher of ``name`` sees it.

    Args:
        engine (`Engine`): the client.
        name (`str`): the adapter name.
        files (`VersionFiles`): the run's files (told about every load and unload).
    """

    def __init__(self, engine: Engine, name: str, files: VersionFiles) -> None:
        self.engine = engine
        self.name = name
        self.files = files
        self.engine_id = engine.instance_id
        self.in_process = is_in_process_id(self.engine_id)
        self.last_in_use: frozenset[str] | None = None
        self._caps: Capabilities | None = None
        self.leaks = SlotLeaks(engine, self.where)  # retired names the engine may still hold
        self.cancelled = CancelledCalls(self)  # what cancelled publishes left running (lorasync.publisher._cancelled)

    @property
    def where(self) -> str:
        return f"{self.engine.kind} at {self.engine.url or '(in-process)'}"

    @property
    def reloads(self) -> bool:
        """The engine may read a version's files again after it let go of it: vLLM rebuilds an
        evicted adapter from its path, SGLang reloads an unloaded name a request still asks for."""
        return bool(self._caps is not None and (self._caps.reloads_from_path or self._caps.unload_drains))

    @property
    def concurrent(self) -> bool:
        """lorasync may call the engine while its caller does (see ``Capabilities.concurrent_calls``)."""
        return self._caps is None or self._caps.concurrent_calls

    @property
    def drains(self) -> bool:
        return bool(self._caps is not None and self._caps.unload_drains)

    async def caps(self) -> Capabilities:
        if self._caps is None:
            self._caps = await self.engine.acapabilities()
        return self._caps

    def forget_caps(self) -> None:
        self._caps = None

    async def sync(self, ledger: Ledger, *, just_loaded: int | None = None) -> None:
        """Read which versions of ``name`` the engine serves now (once until the next failure).

        Versions another publisher loaded count too (fencing is per engine and served name);
        their content hashes are unknown unless the engine names files whose hash is recorded.
        ``just_loaded``: the version this publisher loaded right before (its tensor load's source
        is learnt now).
        """
        if ledger.synced:
            return
        # One look: an engine that names its adapters' sources lists them with it (vLLM: one
        # GET /v1/models either way).
        sources = await self.engine.aadapter_sources()
        listing = list(sources) if sources is not None else await self.engine.alist_adapters()
        await self._recheck_leaks(listed=listing)
        listed = []
        for name in listing:
            parsed = parse_served_name(name)
            if parsed is not None and parsed[0] == self.name:
                listed.append(parsed[1])
        # A version whose verification did not pass has no hash: it is never served ``unchanged``.
        found = {v: None if v in ledger.unverified else self._hash_of(ledger, v, sources, just_loaded=just_loaded) for v in listed}
        for lost in set(ledger.versions) - set(found):
            self.files.released(lost, self.engine_id, reloads=self.reloads)  # restarted or unloaded by someone else
        ledger.versions = found
        ledger.sources = {v: src for v, src in ledger.sources.items() if v in found}
        ledger.unverified &= set(found)
        for version in list(ledger.left_window):
            if version not in found:
                del ledger.left_window[version]
        ledger.synced = True

    def _hash_of(self, ledger: Ledger, version: int, sources: Mapping[str, str | None] | None, *, just_loaded: int | None) -> str | None:
        """The content hash of what the engine serves as ``version``, if it can be known."""
        reported = sources.get(served_name(self.name, version)) if sources is not None else None
        remembered, mine = ledger.versions.get(version), ledger.sources.get(version)
        if reported is not None:
            if remembered is not None and (reported == mine or (mine == LEARN and version == just_loaded)):
                ledger.sources[version] = reported
                return remembered
            ledger.sources.pop(version, None)  # served from elsewhere: its files say what it is, if anything
            found = self.files.content_hash_at(reported, version)
            if found is not None:
                ledger.sources[version] = reported
            return found
        if version == just_loaded:
            return remembered  # listed right after this publisher loaded it: the freshest evidence there is
        if not self.in_process:
            return None  # a remote engine that cannot say which load it serves (it may have restarted)
        return remembered or self.files.store.content_hash_held_by(self.name, version, self.engine_id)

    async def delivered(self, ledger: Ledger, transport: Transport, version: int, digest: str, *, path: str | None, restore: object) -> None:
        """Remember what the engine serves from this publisher now: the hash, where that load came
        from (``path``: its files; else the token the engine gives a tensor load) and, in place,
        what to put it back from (its files, an owned copy, or the Adapter it was published from:
        see :meth:`put_back`)."""
        if isinstance(transport, InPlaceTransport):
            ledger.in_place = (version, digest, restore)
            ledger.in_place_source = path or await self.source_of(self.name)
        elif transport.versioned:
            ledger.versions[version] = digest
            ledger.sources[version] = path or LEARN
            self.leaks.loaded_again(served_name(self.name, version))  # loaded on purpose: no leak
        else:
            ledger.merged = (version, digest)

    async def source_of(self, name: str) -> str | None:
        """Where the engine serves ``name`` from now (None: it cannot tell, or does not serve it)."""
        sources = await self.engine.aadapter_sources()
        return sources.get(name) if sources is not None else None

    async def check_memory(self, ledger: Ledger, transport: Transport) -> None:
        """Forget what this publisher swapped in place or merged if the engine no longer serves
        it: another publisher swapped the name or merged into the engine since, or the engine
        lost the name (design invariant 8: a hash counts only while the engine serves it)."""
        if isinstance(transport, MergedTransport):
            if ledger.merged is not None and not transport.serves(self.engine):
                ledger.merged = None
            return
        if ledger.in_place is None:
            return
        sources = await self.engine.aadapter_sources()
        if sources is not None and sources.get(self.name) != ledger.in_place_source:
            ledger.in_place = ledger.in_place_source = None

    async def in_use(self) -> frozenset[str] | None:
        """Names with running or waiting requests (None: the engine cannot tell, or failed to)."""
        try:
            self.last_in_use = await self.engine.aadapters_in_use()
        except EngineError as exc:
            log.warning("%s cannot report requests in flight (%s); retirement falls back to the grace period", self.where, exc)
            self.last_in_use = None
        return self.last_in_use

    async def make_room(self, ledger: Ledger, policy: Retention, pins: frozenset[int], caps: Capabilities, *, planned: bool = False) -> list[str]:
        """Make room for one more adapter on an engine with a hard adapter limit.

        Only versions that leave the window anyway and have no requests may go early; if that is
        not enough, the publish is refused before anything is unloaded. Engines that reload an
        evicted adapter from its path (vLLM) have no hard limit: nothing is done.

        Returns:
            The served names unloaded to make room.

        Raises:
            CapacityError: no room without unloading a version still needed; nothing was changed.
        """
        if caps.max_loras is None or caps.reloads_from_path:
            return []
        # A retired adapter the engine still holds occupies a slot too (lorasync.publisher._leaks).
        listing = await self.engine.alist_adapters()
        await self._recheck_leaks(listed=listing)
        early = plan_room(
            self.name, ledger, policy, pins, caps,
            loaded=sorted(set(listing) | self.leaks.suspects), busy=await self.in_use(), kept=self.leaks.kept, where=self.where, planned=planned,
        )
        return await self.unload(ledger, early)

    async def retire(self, ledger: Ledger, policy: Retention, pins: frozenset[int], *, closing: bool = False) -> tuple[list[str], list[str]]:
        """Unload the versions outside the window whose requests drained.

        Returns:
            ``(retired, deferred)`` served names.
        """
        name_of = {v: served_name(self.name, v) for v in ledger.versions}
        decision = plan(ledger, policy, name_of=name_of, in_use=await self.in_use(), pins=pins, now=time.monotonic(), closing=closing, drains=self.drains)
        for version, why in decision.forced:
            files = "its files stay until the engine stops reporting it" if self.last_in_use is not None else "its files stay for grace= more"
            warnings.warn(
                f"{served_name(self.name, version)} on {self.where} was unloaded while requests may still use it: "
                f"{why}; {files}. Pin versions that rollouts still need (Publisher.pin / lease) or raise "
                "drain_timeout / max_deferred.",
                RetentionWarning,
                stacklevel=4,
            )
        retired = await self.unload(ledger, decision.unload, forced=[v for v, _ in decision.forced])
        return retired, [served_name(self.name, v) for v in decision.deferred]

    async def unload(self, ledger: Ledger, versions: list[int], *, forced: list[int] | tuple[int, ...] = ()) -> list[str]:
        """Unload ``versions`` (oldest first); returns their served names. ``forced``: those of
        them unloaded while requests may still use them (retention's or a retirement's timeout):
        their requests going on is the forced unload, not a slot the engine kept."""
        self.leaks.forced_out(served_name(self.name, v) for v in forced)
        retired = []
        for version in sorted(versions):
            served = served_name(self.name, version)
            try:
                await self.engine.aunload_adapter(served)
            except AdapterNotFoundError:
                pass  # already gone: the goal holds
            ledger.forget(version)
            if served not in self.leaks.suspects:  # one the engine kept keeps its files until it goes
                self.files.released(version, self.engine_id, reloads=self.reloads)
            retired.append(served)
        if retired:
            await self._recheck_leaks(retired)  # did they leave the engine? (SlotLeakWarning if not)
        return retired

    async def _recheck_leaks(self, retired: list[str] | None = None, *, listed: list[str] | None = None) -> None:
        """Judge whether retired versions left the engine (lorasync.publisher._leaks): one it lists or holds
        keeps its files (it may read them again) until a later check finds it gone."""
        if not retired and not self.leaks.watching:
            return
        for held in await self.leaks.check(retired or (), listed=listed, busy=self.last_in_use):
            parsed = parse_served_name(held)
            if parsed is not None and parsed[0] == self.name:
                self.files.loading(parsed[1], self.engine_id, reloads=self.reloads)
        for gone in self.leaks.freed:
            parsed = parse_served_name(gone)
            if parsed is not None and parsed[0] == self.name:
                self.files.released(parsed[1], self.engine_id, reloads=self.reloads)

    async def verify(self, ledger: Ledger, transport: Transport, probe: Probe, version: int, *, previous: tuple[int, str, object] | None, caps: Capabilities) -> None:
        """Check the trainer's probe through the engine. Only a pass counts (design invariant 11): a
        mismatch or a probe that cannot run (its generate errors or times out: the engine is busy)
        takes the version out (:meth:`take_out`; a cancel is the caller's) and raises VerificationError.
        """
        in_place = isinstance(transport, InPlaceTransport)
        asked = self.name if in_place else (served_name(self.name, version) if transport.versioned else None)
        why, cause = await run_probe(self.engine, probe, asked)
        if why is None:
            return
        done = await self.take_out(ledger, transport, version, caps=caps, previous=previous)
        what = f"{self.name} v{version}" if in_place else (asked or "the merged base")
        hint = "" if cause else "; check scaling (use_rslora / alpha patterns: see normalize_scaling), dtype and the base model"
        message = f"{self.where} does not reproduce the trainer's probe for {what}: {why}. {done}{hint}."
        raise VerificationError(message, engine=self.engine.kind, url=self.engine.url, adapter=asked) from cause

    async def verify_served(self, probe: Probe, served: str | None) -> None:
        """Raise VerificationError unless what serves identical content (``served``; None: the merged
        base) reproduces the probe: "unchanged" is reported only after a pass. Nothing is moved."""
        why, cause = await run_probe(self.engine, probe, served)
        if why is not None:
            message = f"{self.where} serves identical content as {served or 'the merged base'} but does not reproduce the trainer's probe: {why}. Nothing was changed."
            raise VerificationError(message, engine=self.engine.kind, url=self.engine.url, adapter=served) from cause

    async def take_out(self, ledger: Ledger, transport: Transport, version: int, *, caps: Capabilities, previous: tuple[Any, ...] | None) -> str:
        """:meth:`withdraw` a version that did not pass verification. If that fails too (raised as
        VerificationError), nothing of it counts as served: a versioned name stays in
        ``ledger.unverified`` (no hash, retired first, withdrawn before the next load)."""
        if transport.versioned:
            ledger.unverified.add(version)
        try:
            return await self.withdraw(ledger, transport, version, caps=caps, previous=previous)
        except Exception as exc:
            if not transport.versioned:
                ledger.in_place = ledger.in_place_source = ledger.merged = None
                ledger.floor = max(version, ledger.floor or version)
            ledger.synced = False
            message = (
                f"{self.where}: {self.name} v{version} did not pass its verification and taking it out of service failed "
                f"too ({type(exc).__name__}: {exc}); it may still serve, unverified: it is withdrawn again before the next load"
            )
            # An engine that cannot be reached (killed, restarting) is what the caller must act
            # on: the error says so by its type, with the verification story in its message.
            kind = UnverifiedUnreachableError if isinstance(exc, EngineUnavailableError) else VerificationError
            raise kind(message, engine=self.engine.kind, url=self.engine.url, adapter=self.name) from exc

    async def withdraw_unverified(self, ledger: Ledger) -> None:
        """Unload what a failed withdrawal left loaded, unverified (before anything new loads)."""
        if left := sorted(ledger.unverified & set(ledger.versions)):
            await self.unload(ledger, left)

    async def withdraw(self, ledger: Ledger, transport: Transport, version: int, *, caps: Capabilities, previous: tuple[Any, ...] | None) -> str:
        """Take the version just delivered out of service; ``previous``: the ledger's in-place
        or merged entry before it. Returns what was done (for messages)."""
        if isinstance(transport, InPlaceTransport):
            return await self.put_back(ledger, transport, previous)  # type: ignore[arg-type]
        if isinstance(transport, MergedTransport):
            merge = await transport.rollback(self.engine, caps)  # from its own copy of the previous merge
            ledger.merged = previous if transport.serves(self.engine) else None  # type: ignore[assignment]
            return "The previous merge was put back" if merge else "The pristine base weights were put back"
        await self.unload(ledger, [version])
        return "The new version was taken out of service"

    async def put_back(self, ledger: Ledger, transport: InPlaceTransport, previous: tuple[int, str, object] | None) -> str:
        """Serve the previous in-place version again, from what was kept of it: its files or an
        owned copy. Where only the Adapter it was published from is left (no probe had armed a
        copy yet), a copy of that is used if it still hashes to the version's content (a no-copy
        export's tensors have usually moved on). Otherwise the name is unloaded rather than left
        serving weights that failed. Returns what was done."""
        point = previous[2] if previous is not None else None
        if isinstance(point, Adapter) and not isinstance(point, OwnedAdapter):
            copy = await to_thread_untracked(owned_copy, point)
            point = copy if await to_thread_untracked(lambda: copy.content_hash) == previous[1] else None  # type: ignore[index]
        if previous is not None and point is not None:
            await transport.restore(self.engine, name=self.name, previous=point)  # type: ignore[arg-type]
            ledger.in_place, ledger.in_place_source = (previous[0], previous[1], point), await self.source_of(self.name)
            return f"v{previous[0]} was put back"
        try:
            await self.engine.aunload_adapter(self.name)
        except AdapterNotFoundError:
            pass
        ledger.in_place = ledger.in_place_source = None
        if previous is None:
            return f"nothing served before it, so {self.name} was unloaded"
        return (
            f"{self.name} was unloaded: v{previous[0]} was published from the trainer's own tensors, which changed "
            "since, and no copy of it was kept (give the Publisher verify= so every in-place version keeps one, or "
            "publish in place through files with transport='disk')"
        )

    async def settle(self, ledger: Ledger, transport: Transport, version: int, policy: Retention, pins: frozenset[int]) -> None:
        """Re-read what the engine serves once the new version is in.

        The engine may have restarted (losing the new version), and other publishers of this
        name may have loaded newer versions meanwhile; retention and file collection must work
        from the engine's real state, not from this publisher's memory. A version that newer
        ones already push out of the window is taken out of service again, so a stale version
        never serves beside newer ones.

        Raises:
            EngineError: the engine does not list the version it just loaded.
            StaleVersionError: newer versions were loaded concurrently.
        """
        served = served_name(self.name, version)
        ledger.synced = False
        await self.sync(ledger, just_loaded=version)
        if version not in ledger.versions and any(v > version for v in ledger.versions):
            raise StaleVersionError(
                f"{self.name} v{version} was superseded while it loaded: a concurrent publisher of v{max(ledger.versions)} "
                f"already retired it from {self.where}; use the newer version, and give each job that publishes "
                "to this engine a name= of its own",
                adapter=self.name,
                version=version,
                newest=max(ledger.versions),
            )
        if version not in ledger.versions:
            ledger.synced = False
            raise EngineError(
                f"{self.where} does not list {served} right after loading it (it restarted or dropped the adapter); publish again",
                engine=self.engine.kind,
                url=self.engine.url,
                adapter=served,
            )
        if version in policy.window(list(ledger.versions), pins):
            return
        await self.unload(ledger, [version])
        newest = max(ledger.versions)
        raise StaleVersionError(
            f"{self.name} v{version} was superseded while it loaded: {self.where} already serves v{newest} "
            f"(published concurrently), so v{version} was taken out of service again; use the newer version, and "
            "give each job that publishes to this engine a name= of its own",
            adapter=self.name,
            version=version,
            newest=newest,
        )
