"""Publisher and publish_adapter: deliver one adapter version to many engines, safely.

Per engine, concurrently: pre-flight (capabilities, rank, modules, capacity) → choose a transport
→ deliver → optional verify → retire versions beyond the retention window. Invariants:

* Versions are monotonic per (engine, name): an older version never replaces a newer one, and a
  version that concurrent publishers already superseded is taken out of service again.
* Identical content already served moves no bytes.
* A failure on one engine never blocks or changes the others; a failed load or verify leaves the
  engine's previous version serving. The report says exactly what happened where.
* A version's directory is deleted only after every engine of the publish has unloaded it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from lorasync._adapter import Adapter
from lorasync._names import parse_served_name, served_name, validate_name, validate_version
from lorasync._probe import Probe
from lorasync._report import EngineResult, PublishReport
from lorasync.engines._base import Capabilities, Engine
from lorasync.engines._registry import parse_engine_spec
from lorasync.errors import (
    AdapterNotFoundError,
    AdapterRejectedError,
    CapabilityError,
    CapacityError,
    ConfigError,
    EngineError,
    LoraNotEnabledError,
    LoraSyncError,
    StaleVersionError,
    VerificationError,
)
from lorasync.transports._base import Transport
from lorasync.transports._base_weights import BaseWeights
from lorasync.transports._store import DiskStore
from lorasync.transports.disk import DiskTransport
from lorasync.transports.ipc import IPCTransport
from lorasync.transports.merged import DEFAULT_BUCKET_BYTES, MergedTransport

__all__ = ["Publisher", "apublish_adapter", "publish_adapter"]

T = TypeVar("T")
TRANSPORTS = ("auto", "disk", "ipc", "merged")


@dataclass
class _EngineState:
    """What this publisher knows about one engine."""

    caps: Capabilities | None = None
    synced: bool = False
    versions: dict[int, str | None] = field(default_factory=dict)  # loaded version -> content hash (None: unknown)
    merged: tuple[int, str] | None = None  # (version, hash) merged into the base
    in_place: tuple[int, str, Adapter] | None = None  # (version, hash, adapter) served in place


class Publisher:
    """Holds engines and per-engine version state across training steps.

    Args:
        engines: clients from ``lorasync.engines.connect`` or specs like
            ``"vllm:http://127.0.0.1:8000"``.
        name (`str`): the adapter's name; engines serve version N as ``name@vN``.
        transport (`str`): ``"auto"`` (per engine, from its capabilities), ``"disk"``, ``"ipc"``
            or ``"merged"``.
        keep (`int`): versions each engine keeps loaded (older ones are unloaded, then their
            files removed). At least 1.
        root (`str | os.PathLike`, *optional*): disk transport root (default ``/dev/shm/lorasync``).
        base (`BaseWeights | str | os.PathLike`, *optional*): pristine base weights (a HF
            checkpoint dir or ``BaseWeights``); enables the merged fallback.
        bucket_bytes (`int`): merged fallback bucket size.
        verify (`Probe`, *optional*): default probe checked after every load.
        in_place (`bool`): serve every version under the plain ``name``, swapped atomically, on
            engines that support it safely (``capabilities().load_inplace``; the in-process PEFT
            engine). Refused elsewhere: vLLM 0.32's ``load_inplace`` re-reads files every step and
            reuses stale prefix-cache blocks, and SGLang has no in-place update. Version
            monotonicity is then tracked by this publisher only (the engine's names carry none).

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
        base: BaseWeights | str | os.PathLike[str] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        verify: Probe | None = None,
        in_place: bool = False,
    ) -> None:
        if isinstance(engines, (Engine, str)):
            engines = [engines]
        self.engines = [parse_engine_spec(e) for e in engines]
        if not self.engines:
            raise ConfigError("publish needs at least one engine")
        self.name = validate_name(name)
        if transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep must be an int >= 1 (versions kept loaded per engine), got {keep!r}")
        self.transport = transport
        self.keep = keep
        self.verify = verify
        self.in_place = in_place
        if in_place and transport == "merged":
            raise ConfigError("in_place=True serves adapters; it cannot combine with transport='merged'")
        self.store = DiskStore(root)
        self._disk = DiskTransport(self.store)
        self._ipc = IPCTransport()
        if base is not None and not isinstance(base, BaseWeights):
            base = BaseWeights.from_pretrained(base)
        self._merged = MergedTransport(base, bucket_bytes=bucket_bytes) if base is not None else None
        self._state = {id(e): _EngineState() for e in self.engines}
        self._lock = threading.Lock()
        # Sync calls run on one event loop owned by this publisher, so engine clients keep their
        # connections (and TLS setup) from step to step.
        self._loop = _LoopThread()

    # -- public ---------------------------------------------------------------------------------

    def publish(self, adapter: Adapter | nn.Module | Mapping[str, torch.Tensor], *, version: int, verify: Probe | None = None) -> PublishReport:
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

    async def apublish(self, adapter: Adapter | nn.Module | Mapping[str, torch.Tensor], *, version: int, verify: Probe | None = None) -> PublishReport:
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
        await asyncio.to_thread(self._lock.acquire)
        try:
            one = self._publish_in_place if self.in_place else self._publish_one
            results = await asyncio.gather(*(one(e, adapter, version, digest, probe) for e in self.engines))
            t0 = time.perf_counter()
            await self._collect_files(version)
            timings["gc"] = time.perf_counter() - t0
        finally:
            self._lock.release()
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

    def restore_base(self) -> None:
        """Undo merged publishes: every engine this publisher merged into gets its pristine base
        weights back (adapter-serving engines are untouched)."""
        self._loop.run(self.arestore_base())

    async def arestore_base(self) -> None:
        if self._merged is None:
            return
        for engine in self.engines:
            state = self._state[id(engine)]
            if state.merged is not None:
                caps = state.caps or await engine.acapabilities()
                await self._merged.restore(engine, caps)
                state.merged = None

    def close(self) -> None:
        """Close the engines' connections and stop the publisher's event loop (idempotent)."""
        self._stop_loop()
        for engine in self.engines:
            engine.close()

    def _stop_loop(self) -> None:
        # Async clients opened on the publisher's loop are closed on it before it stops.
        if self._loop.running:
            self._loop.run(_aclose_all(self.engines))
        self._loop.stop()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- one engine -------------------------------------------------------------------------------

    async def _publish_one(self, engine: Engine, adapter: Adapter, version: int, digest: str, probe: Probe | None) -> EngineResult:
        result = EngineResult(engine=engine.kind or type(engine).__name__, url=engine.url, status="failed")
        state = self._state[id(engine)]
        served = served_name(self.name, version)
        try:
            t0 = time.perf_counter()
            if state.caps is None:
                state.caps = await engine.acapabilities()
            transport, result.reason = self._choose(engine, state.caps, adapter)
            result.transport = transport.name
            fresh = not state.synced
            await self._sync_versions(engine, state)
            if transport.versioned and not fresh and self._unchanged(state, transport, version, digest):
                # About to move nothing on the strength of memory: ask the engine, which may have
                # restarted (and forgotten every adapter) since this publisher last looked.
                state.synced = False
                await self._sync_versions(engine, state)
            if self._unchanged(state, transport, version, digest):
                # The identical adapter is served under its earlier version's name: report that
                # name, since name@v<version> was not (and need not be) loaded.
                current = served_name(self.name, max(state.versions)) if transport.versioned else ""
                result.status, result.served_name = "unchanged", current
                result.reason = f"already serving identical content ({digest[:12]}); nothing moved"
                return result
            self._check_monotonic(state, transport, version, digest)
            if transport.versioned:
                result.retired = await self._check_capacity(engine, transport, state)
            result.timings["preflight"] = time.perf_counter() - t0

            delivery = await transport.deliver(adapter, engine, state.caps, name=self.name, version=version, served=served)
            result.timings.update(delivery.timings)
            result.bytes_moved = delivery.bytes_moved
            result.served_name = delivery.served_name
            if transport.versioned:
                state.versions[version] = digest
            else:
                state.merged = (version, digest)

            if probe is not None:
                t0 = time.perf_counter()
                await self._verify(engine, transport, probe, served if transport.versioned else None, state, version)
                result.timings["verify"] = time.perf_counter() - t0
                result.reason += "; verified through the engine"
            if transport.versioned:
                t0 = time.perf_counter()
                await self._settle(engine, transport, state, version, served)
                result.retired += await self._retire(engine, transport, state)
                result.timings["retire"] = time.perf_counter() - t0
            result.status = "loaded"
        except LoraSyncError as exc:
            result.error = exc
            state.caps = None  # re-probe next time: the engine may have restarted
            state.synced = False
        except Exception as exc:  # a bug or an untranslated foreign error: report it, typed
            err = EngineError(
                f"{result.engine} at {engine.url or '(in-process)'} failed unexpectedly: {type(exc).__name__}: {exc}",
                engine=result.engine,
                url=engine.url,
                adapter=served,
            )
            err.__cause__ = exc
            result.error = err
            state.caps = None
            state.synced = False
        return result

    async def _publish_in_place(self, engine: Engine, adapter: Adapter, version: int, digest: str, probe: Probe | None) -> EngineResult:
        """One engine, in-place mode: ``name`` switches atomically to the new weights."""
        result = EngineResult(engine=engine.kind or type(engine).__name__, url=engine.url, status="failed", served_name=self.name)
        state = self._state[id(engine)]
        try:
            t0 = time.perf_counter()
            caps = state.caps = state.caps or await engine.acapabilities()
            if not caps.load_inplace:
                raise CapabilityError(
                    f"{caps.engine} at {caps.url or '?'} cannot swap an adapter in place safely; publish versioned "
                    "names (in_place=False, the default)",
                    engine=caps.engine,
                    url=caps.url,
                )
            engine.check_adapter(adapter, caps)
            previous = state.in_place
            if previous is not None and previous[1] == digest and previous[0] <= version:
                result.status, result.reason = "unchanged", f"already serving identical content ({digest[:12]}); nothing moved"
                return result
            if previous is not None and version <= previous[0]:
                raise StaleVersionError(
                    f"{self.name} v{version} would replace v{previous[0]}; versions must increase. Nothing was changed.",
                    adapter=self.name,
                    version=version,
                    newest=previous[0],
                )
            result.timings["preflight"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            if self.transport == "disk" or (self.transport == "auto" and not (caps.in_process and caps.tensor_load)):
                path, _, write_s = await self._disk.write(adapter, self.name, version)
                result.timings["write"] = write_s
                t0 = time.perf_counter()
                await engine.areplace_adapter(self.name, path)
                result.transport, result.bytes_moved = "disk", adapter.nbytes
            else:
                await engine.areplace_adapter_tensors(self.name, adapter)
                result.transport, result.bytes_moved = "ipc", adapter.nbytes
            result.timings["load"] = time.perf_counter() - t0
            result.reason = "in place: the name switched atomically"
            if probe is not None:
                t0 = time.perf_counter()
                ids, logprobs = await engine.agreedy(self.name, list(probe.prompt_ids), len(probe.expected_ids))
                why = probe.mismatch(ids, logprobs)
                if why is not None:
                    if previous is not None:  # put the previous weights back
                        await engine.areplace_adapter_tensors(self.name, previous[2])
                    raise VerificationError(
                        f"{engine.kind} does not reproduce the trainer's probe for {self.name} v{version}: {why}; "
                        + ("the previous version was put back" if previous is not None else "nothing served before it"),
                        engine=engine.kind,
                        url=engine.url,
                        adapter=self.name,
                    )
                result.timings["verify"] = time.perf_counter() - t0
                result.reason += "; verified through the engine"
            state.in_place = (version, digest, adapter)
            result.status = "loaded"
        except LoraSyncError as exc:
            result.error = exc
            state.caps = None
        return result

    def _choose(self, engine: Engine, caps: Capabilities, adapter: Adapter) -> tuple[Transport, str]:
        candidates: dict[str, Transport | None] = {"disk": self._disk, "ipc": self._ipc, "merged": self._merged}
        if self.transport != "auto":
            chosen = candidates[self.transport]
            if chosen is None:
                raise ConfigError("transport='merged' needs base= (the pristine base checkpoint or BaseWeights)")
            why = chosen.unsupported(caps)
            if why is not None:
                raise CapabilityError(f"transport {self.transport!r} cannot serve {caps.engine} at {caps.url or '?'}: {why}", engine=caps.engine, url=caps.url)
            if chosen.versioned:
                engine.check_adapter(adapter, caps)
            return chosen, "requested"
        lora_refusal: LoraSyncError | None = None
        try:
            engine.check_adapter(adapter, caps)
        except (AdapterRejectedError, LoraNotEnabledError) as exc:
            lora_refusal = exc
        if lora_refusal is None:
            order = ("ipc", "disk") if caps.in_process else ("disk", "ipc")
            for name in order:
                transport = candidates[name]
                assert transport is not None
                if transport.unsupported(caps) is None:
                    why = "in-process engine: tensors handed over directly" if name == "ipc" and caps.in_process else (
                        "engine loads LoRA at runtime from this host's tmpfs" if name == "disk" else "engine loads adapters from shared memory"
                    )
                    return transport, why
        if self._merged is not None and self._merged.unsupported(caps) is None:
            return self._merged, f"merged fallback: {lora_refusal or 'engine cannot load this adapter at runtime'}"
        if lora_refusal is not None:
            raise lora_refusal
        raise CapabilityError(
            f"no transport can reach {caps.engine} at {caps.url or '?'}: "
            + "; ".join(f"{n}: {t.unsupported(caps) if t else 'needs base='}" for n, t in candidates.items()),
            engine=caps.engine,
            url=caps.url,
        )

    async def _sync_versions(self, engine: Engine, state: _EngineState) -> None:
        if state.synced:
            return
        found: dict[int, str | None] = {}
        for served in await engine.alist_adapters():
            parsed = parse_served_name(served)
            if parsed is not None and parsed[0] == self.name:
                found[parsed[1]] = state.versions.get(parsed[1]) or self.store.content_hash(self.name, parsed[1])
        state.versions = found
        state.synced = True

    def _unchanged(self, state: _EngineState, transport: Transport, version: int, digest: str) -> bool:
        if not transport.versioned:
            return state.merged is not None and state.merged[1] == digest and state.merged[0] <= version
        if not state.versions:
            return False
        latest = max(state.versions)
        return latest <= version and state.versions[latest] == digest

    def _check_monotonic(self, state: _EngineState, transport: Transport, version: int, digest: str) -> None:
        if transport.versioned:
            newest = max(state.versions, default=None)
            newest_hash = state.versions.get(newest) if newest is not None else None
        else:
            newest, newest_hash = state.merged if state.merged else (None, None)
        if newest is None:
            return
        if version < newest or (version == newest and newest_hash != digest):
            raise StaleVersionError(
                f"{self.name} v{version} would replace v{newest}, which the engine already serves; versions "
                "must increase (use the trainer step). Nothing was changed.",
                adapter=self.name,
                version=version,
                newest=newest,
            )

    async def _check_capacity(self, engine: Engine, transport: Transport, state: _EngineState) -> list[str]:
        """Make room for one more adapter without evicting anything that must keep serving.

        On an engine with a known capacity, versions that fall out of the retention window anyway
        are retired first (never the newest one, which serves until the new version is loaded),
        so concurrent publishers of several names never overrun the engine together. Returns
        what was retired.
        """
        caps = state.caps
        assert caps is not None
        if caps.max_loras is None:
            return []
        loaded = await engine.alist_adapters()
        retired: list[str] = []
        doomed = sorted(state.versions)[: max(0, len(state.versions) - max(self.keep - 1, 1))]
        while doomed:
            old = doomed.pop(0)
            old_served = served_name(self.name, old)
            try:
                await transport.retire(engine, name=self.name, version=old, served=old_served)
            except AdapterNotFoundError:
                pass
            state.versions.pop(old, None)
            retired.append(old_served)
            loaded = [n for n in loaded if n != old_served]
        if len(loaded) + 1 > caps.max_loras:
            raise CapacityError(
                f"{caps.engine} at {caps.url or '?'} already holds {len(loaded)} adapters ({', '.join(sorted(loaded)[:8])}) "
                f"and can hold {caps.max_loras} without evicting one it serves; lower keep= (now {self.keep}), unload "
                "adapters, or restart the engine with more slots (vLLM --max-cpu-loras/--max-loras, SGLang --max-loaded-loras)",
                engine=caps.engine,
                url=caps.url,
                capacity=caps.max_loras,
            )
        return retired

    async def _verify(self, engine: Engine, transport: Transport, probe: Probe, served: str | None, state: _EngineState, version: int) -> None:
        ids, logprobs = await engine.agreedy(served, list(probe.prompt_ids), len(probe.expected_ids))
        why = probe.mismatch(ids, logprobs)
        if why is None:
            return
        # Take the new version out of service so the previous one keeps serving.
        if transport.versioned and served is not None:
            try:
                await engine.aunload_adapter(served)
            except AdapterNotFoundError:
                pass
            state.versions.pop(version, None)
        raise VerificationError(
            f"{engine.kind} at {engine.url or '(in-process)'} does not reproduce the trainer's probe for "
            f"{served or 'the merged base'}: {why}. The new version was taken out of service; check scaling "
            "(use_rslora / alpha patterns: see normalize_scaling), dtype and the base model.",
            engine=engine.kind,
            url=engine.url,
            adapter=served,
        )

    async def _settle(self, engine: Engine, transport: Transport, state: _EngineState, version: int, served: str) -> None:
        """Re-read what the engine serves once the new version is in.

        The engine may have restarted (losing the new version), and other publishers of this
        name may have loaded newer versions meanwhile; retention and file collection must work
        from the engine's real state, not from this publisher's memory. A version that newer
        ones already push out of the retention window is taken out of service again, so a stale
        version never serves beside newer ones.

        Raises:
            EngineError: the engine does not list the version it just loaded.
            StaleVersionError: ``keep`` newer versions were loaded concurrently.
        """
        state.synced = False
        await self._sync_versions(engine, state)
        if version not in state.versions and any(v > version for v in state.versions):
            raise StaleVersionError(
                f"{self.name} v{version} was superseded while it loaded: a concurrent publisher of v{max(state.versions)} "
                f"already retired it from {engine.kind} at {engine.url or '(in-process)'}; use the newer version",
                adapter=self.name,
                version=version,
                newest=max(state.versions),
            )
        if version not in state.versions:
            state.synced = False
            raise EngineError(
                f"{engine.kind} at {engine.url or '(in-process)'} does not list {served} right after loading it "
                "(it restarted or dropped the adapter); publish again",
                engine=engine.kind,
                url=engine.url,
                adapter=served,
            )
        if version in sorted(state.versions)[-self.keep :]:
            return
        try:
            await transport.retire(engine, name=self.name, version=version, served=served)
        except AdapterNotFoundError:
            pass
        state.versions.pop(version, None)
        newest = max(state.versions)
        raise StaleVersionError(
            f"{self.name} v{version} was superseded while it loaded: {engine.kind} at {engine.url or '(in-process)'} "
            f"already serves v{newest} (published concurrently), so v{version} was taken out of service again; "
            "use the newer version",
            adapter=self.name,
            version=version,
            newest=newest,
        )

    async def _retire(self, engine: Engine, transport: Transport, state: _EngineState) -> list[str]:
        retired = []
        for old in sorted(state.versions)[: -self.keep]:
            old_served = served_name(self.name, old)
            try:
                await transport.retire(engine, name=self.name, version=old, served=old_served)
            except AdapterNotFoundError:
                pass  # already gone: the goal holds
            state.versions.pop(old, None)
            retired.append(old_served)
        return retired

    async def _collect_files(self, current: int) -> None:
        """Delete version directories no engine of this publisher holds: never the newest
        ``keep`` versions, never one newer than ``current`` (concurrent publishers own those).

        Best effort. It runs only when no load of this name is in flight anywhere (the store's
        lock: loaders hold it shared from write to load) and re-lists the engines under that
        lock, so a concurrent publisher's version is never deleted between its load and this
        publisher's view of the engines (vLLM re-reads an evicted adapter's files).
        """
        if self.in_place:
            # In-place engines read a version's files only during the swap.
            published = await asyncio.to_thread(self.store.versions, self.name)
            for old in sorted(published)[: -self.keep]:
                if old < current:
                    await asyncio.to_thread(self.store.remove, self.name, old)
            return
        if any(not state.synced for state in self._state.values()):
            return  # an engine's view is unknown (it failed): keep every file
        published = await asyncio.to_thread(self.store.versions, self.name)
        window = set(sorted(published)[-self.keep :]) | {current}
        candidates = [v for v in published if v < current and v not in window]
        if not candidates:
            return
        lock = await asyncio.to_thread(self.store.lock, self.name, exclusive=True, blocking=False)
        if lock is None:
            return  # a load is in flight; a later publish collects
        try:
            held: set[int] = set()
            for engine in self.engines:
                for served in await engine.alist_adapters():
                    parsed = parse_served_name(served)
                    if parsed is not None and parsed[0] == self.name:
                        held.add(parsed[1])
            for version in candidates:
                if version not in held:
                    await asyncio.to_thread(self.store.remove, self.name, version)
        except LoraSyncError:
            return  # an engine failed to list or a removal failed: keep the rest for later
        finally:
            lock.close()


def publish_adapter(
    adapter: Adapter | nn.Module | Mapping[str, torch.Tensor],
    engines: Iterable[Engine | str] | Engine | str,
    *,
    name: str,
    version: int,
    transport: str = "auto",
    keep: int = 2,
    verify: Probe | None = None,
    root: str | os.PathLike[str] | None = None,
    base: BaseWeights | str | os.PathLike[str] | None = None,
) -> PublishReport:
    """Publish ``adapter`` as ``name@v<version>`` to every engine and report what happened.

    Stateless: versions already loaded on each engine are read from the engine itself, so a
    restarted trainer keeps monotonic versions and retention. For every-step use, keep a
    :class:`Publisher` (it caches capabilities and state).

    Args:
        adapter: an :class:`Adapter`, or a PEFT model / state dict (exported first).
        engines: engine clients or specs like ``"vllm:http://127.0.0.1:8000"``.
        name (`str`): adapter name (ASCII letters, digits, ``._-``).
        version (`int`): monotonic version, e.g. the trainer step.
        transport (`str`): ``"auto"``, ``"disk"``, ``"ipc"`` or ``"merged"``.
        keep (`int`): versions kept loaded per engine.
        verify (`Probe`, *optional*): checked through each engine after loading.
        root: disk transport root. base: pristine base weights for the merged fallback.

    Returns:
        `PublishReport`: ``report.served_name`` is the name to request; ``report.ok`` tells
        whether every engine serves it.

    Raises:
        InvalidNameError, ConfigError, AdapterError: bad arguments (nothing was sent).

    Example:
        >>> report = publish_adapter(adapter, ["vllm:http://127.0.0.1:8000"], name="policy", version=12)  # doctest: +SKIP
        >>> report.served_name
        'policy@v12'
    """
    publisher = Publisher(engines, name=name, transport=transport, keep=keep, root=root, base=base, verify=verify)
    try:
        return publisher.publish(adapter, version=version)
    finally:
        publisher._stop_loop()  # the caller's engine objects stay open


async def apublish_adapter(
    adapter: Adapter | nn.Module | Mapping[str, torch.Tensor],
    engines: Iterable[Engine | str] | Engine | str,
    *,
    name: str,
    version: int,
    transport: str = "auto",
    keep: int = 2,
    verify: Probe | None = None,
    root: str | os.PathLike[str] | None = None,
    base: BaseWeights | str | os.PathLike[str] | None = None,
) -> PublishReport:
    """Async twin of :func:`publish_adapter`."""
    publisher = Publisher(engines, name=name, transport=transport, keep=keep, root=root, base=base, verify=verify)
    return await publisher.apublish(adapter, version=version)


async def _aclose_all(engines: Iterable[Engine]) -> None:
    for engine in engines:
        await engine.aclose()


class _LoopThread:
    """An event loop in a daemon thread, started on first use; sync code submits coroutines.

    Works whether or not the caller's thread already runs a loop (notebooks, async trainers).
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        with self._guard:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="lorasync-publisher", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    @property
    def running(self) -> bool:
        return self._loop is not None

    def stop(self) -> None:
        with self._guard:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()
