"""The engine protocol: one small class every engine client (built-in or plugin) subclasses.

Required (sync): ``capabilities``, ``load_adapter``, ``unload_adapter``, ``list_adapters``.
Optional: ``load_adapter_tensors`` (file-less IPC) and ``update_weights`` (merged fallback);
both raise ``CapabilityError`` unless overridden. ``check_adapter`` holds the engine's own
refusal rules (the publisher calls it before any bytes move, for every transport that serves
LoRA); ``adapters_in_use`` tells which served names running or waiting requests use, so
retirement never unloads a version under a decoding request. Async twins (``a``-prefixed) default to running
the sync method in a worker thread; HTTP clients override them with real async I/O.

Contract for implementers:

* Every failure leaves as a ``lorasync.errors.EngineError`` subclass, never a foreign exception.
* ``load_adapter(name, path)`` returns only once the engine serves ``name`` from ``path``.
  If it raises, the engine still serves whatever it served before under other names.
* ``unload_adapter`` of an unknown name raises ``AdapterNotFoundError``.
* ``list_adapters`` returns the adapter names (not base models) the engine serves now.
* ``adapter_sources`` (optional) says where each served adapter was loaded from: a path the
  engine read, or a token no other load shares. The publisher trusts a content hash it
  remembered (or recorded beside the files) only while the engine still serves that very load.

Identity: ``instance_id`` names the engine instance in the store's holders records and in the
publisher's hash bookkeeping. An engine outside this process (``remote``: a server, a Ray actor)
is ``kind:url``, the same for every client of it; any other engine's id is unique to its process
and object, so two jobs (or two engine objects on one base model) never pass for one engine.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from lorasync.runtime._lifecycle import Closing
from lorasync.runtime._loop import to_thread
from lorasync.errors import CapabilityError, IncompatibleAdapterError, LoraNotEnabledError, RankTooLargeError

if TYPE_CHECKING:
    import torch

    from lorasync.adapter._adapter import Adapter

__all__ = ["IN_PROCESS_MARK", "Capabilities", "Engine", "is_in_process_id"]

#: Marks an in-process engine's :attr:`Engine.instance_id` (the pid and a random token follow).
IN_PROCESS_MARK = "#in-process:"


def is_in_process_id(instance_id: str) -> bool:
    """Whether ``instance_id`` names an engine inside one process (gone with it). Records of
    releases before instance ids had a mark named such engines ``kind:`` (an empty url)."""
    return IN_PROCESS_MARK in instance_id or instance_id.endswith(":")


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, as far as lorasync needs to know."""

    engine: str
    url: str = ""
    lora: bool = True  # serves LoRA adapters at all
    runtime_lora: bool = True  # can load/unload adapters while running
    max_rank: int | None = None  # None: unknown
    max_loras: int | None = None  # adapters it can hold at once without evicting; None: unknown
    target_modules: frozenset[str] | None = None  # leaf names it can serve; None: any
    tensor_load: bool = False  # load_adapter_tensors works (no files)
    weight_update: bool = False  # update_weights works (merged fallback)
    load_inplace: bool = False  # replace_adapter swaps one name atomically and safely
    same_host: bool = True  # shares this host's filesystem / shared memory
    in_process: bool = False  # lives in this Python process (tensors hand over directly)
    # Takes a GPU adapter device to device (CUDA IPC into its workers' GPUs) when the tensors
    # live on a GPU of this host: the default transport then prefers tensors over files.
    device_tensors: bool = False
    # Re-reads a registered adapter from its path when it was evicted (vLLM's LRU): no hard slot
    # limit, but the files must outlive every request that may need them.
    reloads_from_path: bool = False
    # Its unload waits for the requests running on that adapter (SGLang 0.5.23): an engine that
    # cannot report requests in flight needs no grace period then.
    unload_drains: bool = False
    # May be called from lorasync's thread while the caller uses the engine itself (False: an
    # in-process engine the caller drives directly, like a sync vllm.LLM, whose calls must never
    # overlap): then a publish retires old versions before it returns, not in the background.
    concurrent_calls: bool = True
    fused_modules: tuple[tuple[str, ...], ...] = ()  # leaf groups stored as one weight (merged updates send whole groups)
    # Loads PEFT's fused 3-D MoE expert LoRA besides per-expert keys (vLLM --enable-mixed-moe-lora-format).
    moe_3d: bool = False
    # The engine's release as it reports it (vLLM's /version, vllm.__version__); None: unknown.
    # Rules that differ between releases read it (vLLM 0.26 ignores MoE router LoRA).
    version: str | None = None
    notes: tuple[str, ...] = field(default=())

    def check(
        self,
        adapter: Adapter,
        *,
        enable_lora: str = "start it with LoRA enabled or publish with transport='merged'",
        raise_rank: str = "restart the engine with a larger max rank (vLLM --max-lora-rank, SGLang "
        "--max-lora-rank) or train r <= {max_rank}",
    ) -> None:
        """Pre-flight: refuse, before any bytes move, an adapter this engine cannot serve.

        Args:
            adapter (`Adapter`): the adapter to serve.
            enable_lora (`str`): what to do when the engine serves no LoRA (an engine that is
                not a server started with flags words it its own way).
            raise_rank (`str`): what to do when the rank is too large; ``{rank}`` and
                ``{max_rank}`` are filled in.

        Raises:
            LoraNotEnabledError, RankTooLargeError, IncompatibleAdapterError.
        """
        if not self.lora:
            raise LoraNotEnabledError(
                f"{self.engine} at {self.url or '?'} serves no LoRA adapters; {enable_lora}",
                engine=self.engine,
                url=self.url,
            )
        rank = max(adapter.pair(m)[0].shape[0] for m in adapter.modules)
        if self.max_rank is not None and rank > self.max_rank:
            raise RankTooLargeError(
                f"adapter rank {rank} exceeds {self.engine}'s max LoRA rank {self.max_rank}; "
                + raise_rank.format(rank=rank, max_rank=self.max_rank),
                engine=self.engine,
                url=self.url,
                rank=rank,
                max_rank=self.max_rank,
            )
        if self.target_modules is not None:
            leaves = {m.rsplit(".", 1)[-1] for m in adapter.modules}
            outside = sorted(leaves - self.target_modules)
            if outside:
                raise IncompatibleAdapterError(
                    f"adapter targets {outside}, which {self.engine} was not started for (serves "
                    f"{sorted(self.target_modules)}); restart it with those modules in --lora-target-modules",
                    engine=self.engine,
                    url=self.url,
                    modules=outside,
                )


class Engine(Closing):
    """What every engine client subclasses: set ``kind`` and implement the four methods."""

    kind: ClassVar[str] = ""
    url: str = ""
    #: The engine lives outside this process and other processes may drive it too (a server, a
    #: Ray actor): it is then identified by ``kind:url``. None: an ``http(s)://`` url says so.
    remote: ClassVar[bool | None] = None
    #: ``load_adapter_tensors`` and ``replace_adapter_tensors`` keep nothing of the tensors they
    #: are given once they return: they copy them into the engine's own memory (PEFT's slots, a
    #: vLLM worker's staging). False (the default, for engines that do not say): an engine in
    #: this process is handed a copy lorasync owns, because the Adapter of a no-copy export *is*
    #: the trainer's memory, which the next optimizer step changes in place (design invariant
    #: 7). Engines in other processes get their bytes copied on the way anyway.
    copies_tensors: ClassVar[bool] = False
    #: What to change on this engine to get a capability it lacks, by ``Capabilities`` field
    #: (``runtime_lora``, ``tensor_load``, ``weight_update``, ``lora``, ``same_host``): the flag,
    #: the environment variable. Transport selection appends it to its refusal, so the error says
    #: how to start the engine, not only what is missing.
    remedies: ClassVar[Mapping[str, str]] = {}

    @property
    def instance_id(self) -> str:
        """Who this engine is, for holders records and content-hash bookkeeping.

        ``kind:url`` for a remote engine (every client of one server is that server); for any
        other engine ``kind:url#in-process:<pid>:<token>``, unique to this process and object
        (two ``PeftEngine`` objects on one base model, or the same code in two jobs, are
        different engines). Stable for the object's lifetime.
        """
        base = f"{self.kind or type(self).__name__}:{self.url}"
        remote = self.remote if self.remote is not None else self.url.startswith(("http://", "https://"))
        if remote:
            return base
        # Kept on the object (its __dict__, not a slot: subclasses need not cooperate), and
        # renewed in a forked child, which is another process with its own copy of the engine.
        slots = getattr(self, "__dict__", None)
        token = slots.get("_lorasync_instance") if slots is not None else (os.getpid(), f"{id(self):x}")
        if token is None or token[0] != os.getpid():
            token = slots["_lorasync_instance"] = (os.getpid(), secrets.token_hex(6))  # type: ignore[index]
        return f"{base}{IN_PROCESS_MARK}{token[0]}:{token[1]}"

    # -- required ---------------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        """What this engine supports now (may ask the engine; cheap to call again)."""
        raise NotImplementedError

    def load_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        """Load the PEFT adapter directory ``path`` under ``name`` and return once it serves.

        Raises:
            AdapterAlreadyLoadedError, AdapterNotFoundError, AdapterRejectedError,
            EngineUnavailableError, ... (all ``EngineError``).
        """
        raise NotImplementedError

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name``. Raises ``AdapterNotFoundError`` if it is not loaded."""
        raise NotImplementedError

    def list_adapters(self) -> list[str]:
        """Names of the adapters served now."""
        raise NotImplementedError

    # -- optional -----------------------------------------------------------------------------

    def check_adapter(self, adapter: Adapter, caps: Capabilities) -> None:
        """Refuse, before any bytes move, an adapter this engine cannot serve as LoRA.

        The publisher calls it for every transport that serves the adapter as LoRA (disk, ipc,
        in-place), never for the merged fallback. The default applies the generic checks of
        ``caps.check``; engines with rules of their own (SGLang ignores rsLoRA, ...) override it
        and call ``super().check_adapter`` first.

        Raises:
            LoraNotEnabledError, RankTooLargeError, IncompatibleAdapterError (``EngineError``).
        """
        caps.check(adapter)

    def adapter_sources(self) -> Mapping[str, str | None] | None:
        """Where each served adapter was loaded from, by served name: the path the engine read
        it from, or a token unique to that load (a tensor load); None for a name the engine
        cannot say it of. ``None`` altogether: the engine cannot tell (the default).

        The publisher reuses a content hash for a listed name only while the engine still serves
        the very load it hashed: a restarted engine that another job loaded the same name into
        reports another source. Engines that cannot tell are trusted only in this process.

        Raises:
            EngineError: the engine could not be asked.
        """
        return None

    def adapters_in_use(self) -> frozenset[str] | None:
        """Served names that running or waiting requests use right now, as far as the engine can
        tell; ``None`` when it cannot tell at all (then retirement relies on a grace period).

        A name in the set must not be unloaded (nor its files deleted): the engine may still
        need it, and vLLM reloads an evicted adapter from its path for a running request.

        Raises:
            EngineError: the engine could not be asked.
        """
        return None

    def load_adapter_tensors(self, name: str, adapter: Adapter) -> None:
        """Load ``adapter`` under ``name`` without files (shared memory / IPC)."""
        raise CapabilityError(f"{self.kind or type(self).__name__} cannot load adapters from tensors; publish with transport='disk' (or 'auto')", engine=self.kind)

    def replace_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        """Atomically make ``name`` serve the adapter at ``path`` (in-place publishing): every
        request sees the old or the new weights, never a mix, and a failure keeps the old.
        Only engines whose ``capabilities().load_inplace`` is True implement it."""
        raise CapabilityError(f"{self.kind or type(self).__name__} cannot replace adapters in place; publish versioned names (in_place=False, the default)", engine=self.kind)

    def replace_adapter_tensors(self, name: str, adapter: Adapter) -> None:
        """:meth:`replace_adapter` from tensors, without files."""
        raise CapabilityError(f"{self.kind or type(self).__name__} cannot replace adapters in place; publish versioned names (in_place=False, the default)", engine=self.kind)

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace base weights in place (the merged fallback). Names are HF parameter names."""
        raise CapabilityError(f"{self.kind or type(self).__name__} cannot update weights; publish LoRA with transport='disk' or 'ipc' (or 'auto')", engine=self.kind)

    def begin_weight_update(self) -> None:
        """Called before a series of ``update_weights`` buckets: hold requests so none sees half
        an update. Default: nothing."""

    def end_weight_update(self) -> None:
        """Called after the last bucket (also on failure). Default: nothing."""

    def greedy(self, name: str | None, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy-decode ``max_tokens`` tokens after ``prompt_ids`` with adapter ``name`` (None:
        the base model). Returns the token ids and each chosen token's log-probability; used by
        verification probes."""
        raise CapabilityError(f"{self.kind or type(self).__name__} cannot generate, so it cannot be verified; publish without verify= (or implement greedy())", engine=self.kind)

    def close(self) -> None:
        """Release connections. Idempotent."""

    def home_loop(self) -> "asyncio.AbstractEventLoop | None":
        """The event loop this engine's calls must run on (an AsyncLLM's), or None (any loop)."""
        return None

    # -- async twins (default: the sync method in a daemon worker thread, lorasync.runtime._loop.to_thread) --

    async def acapabilities(self) -> Capabilities:
        return await to_thread(self.capabilities)

    async def aload_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        await to_thread(self.load_adapter, name, path)

    async def aunload_adapter(self, name: str) -> None:
        await to_thread(self.unload_adapter, name)

    async def alist_adapters(self) -> list[str]:
        return await to_thread(self.list_adapters)

    async def aadapters_in_use(self) -> frozenset[str] | None:
        return await to_thread(self.adapters_in_use)

    async def aadapter_sources(self) -> Mapping[str, str | None] | None:
        if type(self).adapter_sources is Engine.adapter_sources:
            return None  # cannot tell: no thread hop for it
        return await to_thread(self.adapter_sources)

    async def aload_adapter_tensors(self, name: str, adapter: Adapter) -> None:
        await to_thread(self.load_adapter_tensors, name, adapter)

    async def areplace_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        await to_thread(self.replace_adapter, name, path)

    async def areplace_adapter_tensors(self, name: str, adapter: Adapter) -> None:
        await to_thread(self.replace_adapter_tensors, name, adapter)

    async def aupdate_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        await to_thread(self.update_weights, named_tensors)

    async def abegin_weight_update(self) -> None:
        await to_thread(self.begin_weight_update)

    async def aend_weight_update(self) -> None:
        await to_thread(self.end_weight_update)

    async def agreedy(self, name: str | None, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        return await to_thread(self.greedy, name, prompt_ids, max_tokens)

    async def aclose(self) -> None:
        self.close()


    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r})"
