"""EngineHandle: the publisher's side of one engine — capabilities, the version ledger's sync with
the engine, capacity, verification, settling after a load and unloading retired versions.

The publisher owns one handle per engine and calls it under its lock; the decisions of what to
retire are :func:`lorasync._retention.plan`'s, the files' fate is :class:`lorasync._files.VersionFiles`'.
"""

from __future__ import annotations

import logging
import time
import warnings

from lorasync._files import VersionFiles
from lorasync._names import parse_served_name, served_name
from lorasync._probe import Probe
from lorasync._retention import Ledger, Retention, RetentionWarning, plan
from lorasync.engines._engine import Capabilities, Engine
from lorasync.errors import AdapterNotFoundError, CapacityError, EngineError, StaleVersionError, VerificationError
from lorasync.transports._transport import Transport
from lorasync.transports.inplace import InPlaceTransport

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
        self.engine_id = f"{engine.kind or type(engine).__name__}:{engine.url}"
        self.last_in_use: frozenset[str] | None = None
        self._caps: Capabilities | None = None

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

    async def sync(self, ledger: Ledger) -> None:
        """Read which versions of ``name`` the engine serves now (once until the next failure).

        Versions another publisher loaded count too (fencing is per engine and served name);
        their content hashes are unknown unless this run wrote them.
        """
        if ledger.synced:
            return
        found: dict[int, str | None] = {}
        for listed in await self.engine.alist_adapters():
            parsed = parse_served_name(listed)
            if parsed is not None and parsed[0] == self.name:
                found[parsed[1]] = ledger.versions.get(parsed[1]) or self.files.store.content_hash_held_by(self.name, parsed[1], self.engine_id)
        for lost in set(ledger.versions) - set(found):
            self.files.released(lost, self.engine_id, reloads=self.reloads)  # restarted or unloaded by someone else
        ledger.versions = found
        for version in list(ledger.left_window):
            if version not in found:
                del ledger.left_window[version]
        ledger.synced = True

    async def in_use(self) -> frozenset[str] | None:
        """Names with running or waiting requests (None: the engine cannot tell, or failed to)."""
        try:
            self.last_in_use = await self.engine.aadapters_in_use()
        except EngineError as exc:
            log.warning("%s cannot report requests in flight (%s); retirement falls back to the grace period", self.where, exc)
            self.last_in_use = None
        return self.last_in_use

    async def make_room(self, ledger: Ledger, policy: Retention, pins: frozenset[int], caps: Capabilities) -> list[str]:
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
        loaded = await self.engine.alist_adapters()
        # After the new version loads, the window moves: versions it pushes out go now, before the
        # load, so concurrent publishers of several names never overrun the engine together.
        future = dict.fromkeys(ledger.versions) | {max(ledger.versions, default=-1) + 1: None}
        window = policy.window(list(future), pins)
        busy = await self.in_use()
        early = [v for v in sorted(ledger.versions) if v not in window and (busy is None or served_name(self.name, v) not in busy)]
        if busy is None:
            # Requests unknown (SGLang, whose unload then waits for them): only as many as the load
            # needs, so an engine with room never waits on a draining unload before it loads.
            early = early[: max(0, len(loaded) + 1 - caps.max_loras)]
        elif len(loaded) - len(early) + 1 > caps.max_loras:
            early = []  # not enough room even so: refuse below, before unloading anything
        if len(loaded) - len(early) + 1 > caps.max_loras:
            others = sorted(n for n in loaded if (parse_served_name(n) or ("", 0))[0] != self.name)
            advice = []
            if caps.max_loras <= policy.keep:
                advice.append(f"restart the engine with more adapter slots than keep={policy.keep} (vLLM --max-cpu-loras, SGLang --max-loaded-loras)")
            else:
                advice.append(f"lower keep= (now {policy.keep}) or restart the engine with more slots (SGLang --max-loaded-loras)")
            if caps.load_inplace:
                advice.append("publish in place (in_place=True), which needs no second slot")
            advice.append("or publish with transport='merged' (base=...), which needs no slot")
            raise CapacityError(
                f"{self.where} holds {len(loaded)} adapters ({', '.join(sorted(loaded)[:8])}) and can hold {caps.max_loras}; "
                f"none of them may go without taking one out from under a request or the retention window"
                + (f" (other adapters: {', '.join(others[:4])})" if others else "")
                + "; nothing was unloaded. To publish: " + "; ".join(advice),
                engine=caps.engine,
                url=caps.url,
                capacity=caps.max_loras,
            )
        return await self.unload(ledger, early)

    async def retire(self, ledger: Ledger, policy: Retention, pins: frozenset[int], *, closing: bool = False) -> tuple[list[str], list[str]]:
        """Unload the versions outside the window whose requests drained.

        Returns:
            ``(retired, deferred)`` served names.
        """
        decision = plan(
            ledger,
            policy,
            name_of={v: served_name(self.name, v) for v in ledger.versions},
            in_use=await self.in_use(),
            pins=pins,
            now=time.monotonic(),
            closing=closing,
            drains=self.drains,
        )
        for version, why in decision.forced:
            warnings.warn(
                f"{served_name(self.name, version)} on {self.where} was unloaded although requests still used it: "
                f"{why}; its files stay until the engine stops reporting it. Pin versions that rollouts still "
                "need (Publisher.pin / lease) or raise drain_timeout / max_deferred.",
                RetentionWarning,
                stacklevel=4,
            )
        retired = await self.unload(ledger, decision.unload)
        return retired, [served_name(self.name, v) for v in decision.deferred]

    async def unload(self, ledger: Ledger, versions: list[int]) -> list[str]:
        """Unload ``versions`` (oldest first); returns their served names."""
        retired = []
        for version in sorted(versions):
            served = served_name(self.name, version)
            try:
                await self.engine.aunload_adapter(served)
            except AdapterNotFoundError:
                pass  # already gone: the goal holds
            ledger.forget(version)
            self.files.released(version, self.engine_id, reloads=self.reloads)
            retired.append(served)
        return retired

    async def verify(self, ledger: Ledger, transport: Transport, probe: Probe, version: int, *, previous: tuple[int, str, object] | None) -> None:
        """Check the trainer's probe through the engine; on a mismatch put things back and raise.

        Raises:
            VerificationError: the engine does not reproduce the probe (the new version was taken
                out of service, or the previous in-place weights were put back).
        """
        in_place = isinstance(transport, InPlaceTransport)
        asked = self.name if in_place else (served_name(self.name, version) if transport.versioned else None)
        ids, logprobs = await self.engine.agreedy(asked, list(probe.prompt_ids), len(probe.expected_ids))
        why = probe.mismatch(ids, logprobs)
        if why is None:
            return
        if in_place:
            if previous is not None:
                await transport.restore(self.engine, name=self.name, previous=previous[2])  # type: ignore[arg-type]
            ledger.in_place = previous
            raise VerificationError(
                f"{self.engine.kind} does not reproduce the trainer's probe for {self.name} v{version}: {why}; "
                + ("the previous version was put back" if previous is not None else "nothing served before it"),
                engine=self.engine.kind,
                url=self.engine.url,
                adapter=self.name,
            )
        if transport.versioned:
            await self.unload(ledger, [version])
        raise VerificationError(
            f"{self.where} does not reproduce the trainer's probe for {asked or 'the merged base'}: {why}. The new "
            "version was taken out of service; check scaling (use_rslora / alpha patterns: see normalize_scaling), "
            "dtype and the base model.",
            engine=self.engine.kind,
            url=self.engine.url,
            adapter=asked,
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
        digest = ledger.versions.get(version)
        ledger.synced = False
        await self.sync(ledger)
        if version in ledger.versions and ledger.versions[version] is None:
            ledger.versions[version] = digest
        if version not in ledger.versions and any(v > version for v in ledger.versions):
            raise StaleVersionError(
                f"{self.name} v{version} was superseded while it loaded: a concurrent publisher of v{max(ledger.versions)} "
                f"already retired it from {self.where}; use the newer version",
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
            f"(published concurrently), so v{version} was taken out of service again; use the newer version",
            adapter=self.name,
            version=version,
            newest=newest,
        )
