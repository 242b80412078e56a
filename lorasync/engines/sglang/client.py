"""The SGLang engine client: runtime LoRA load/unload over HTTP, tensor loads, merged fallback.

Every operation is written once as a sans-IO generator (see :mod:`lorasync.engines._http`) and
driven sync or async; the package's other modules hold what the client knows about SGLang
(0.5.23 unless ``version=`` says otherwise; see ``docs/engines/sglang.md``): the adapter rules
(:mod:`.rules`), the answers' error texts (:mod:`.errors`) and the payloads (:mod:`.protocol`).

* The capability gate is ``/server_info`` (``/get_server_info`` on older servers): ``enable_lora``,
  ``max_lora_rank``, ``lora_target_modules`` (SGLang compares *packed* names: ``q_proj`` covers
  ``k_proj`` and ``v_proj`` too), ``max_loaded_loras``, ``dp_size``, ``tokenizer_worker_num``.
* A retried load answered "already loaded", or a 200 that is not SGLang's envelope, counts only
  once ``/v1/models`` lists the name with our path (an earlier attempt landed, its answer lost).
* Loads from tensors speak the protocol the server's routes offer (:mod:`.tensors`): the legacy
  ``/load_lora_adapter_from_tensors`` or SGLang main's streamed adapters (``/register_lora_adapter``
  and a weight-update stream); ``capabilities().notes`` names it. A load whose answer is lost,
  or whose caller is cancelled, is undone (its name unregistered, its session closed).
* SGLang allows one weight-update session at a time: this process's clients of one server take
  turns for streamed loads and merged updates (:class:`.sessions.SessionGate`).
* 0.5.23 accepts ``/update_weights_from_tensor`` only inside ``/begin_weight_update`` ...
  ``/end_weight_update``; the session is always closed, also when an update fails.
* Unload: SGLang 0.5.23 marks the adapter unloading (new requests naming it are refused) and
  waits until every request holding it has finished before it tells the scheduler (see
  ``docs/engines/sglang.md``); no route reports which adapters requests hold, so
  :meth:`SGLangEngine.adapters_in_use` returns ``None``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

from lorasync.runtime._retry import RetryPolicy
from lorasync.engines._engine import Capabilities
from lorasync.engines._hosts import is_same_host
from lorasync.engines.sglang import rules
from lorasync.engines.sglang.tensors import TensorLoads
from lorasync.engines.sglang.protocol import DEFAULT_VERSION, STREAMED, GenerateResult, parse_version
from lorasync.engines.sglang.sessions import SessionGate
from lorasync.errors import ConfigError, EngineError

if TYPE_CHECKING:
    import os

    import httpx
    import torch

    from lorasync.adapter._adapter import Adapter

__all__ = ["SGLangEngine"]


class SGLangEngine(TensorLoads):
    """Client of one SGLang server (``python -m sglang.launch_server``).

    The server must run with ``--enable-lora --max-lora-rank R --lora-target-modules ...``,
    ``--tokenizer-worker-num 1`` and ``--dp-size 1`` for runtime LoRA updates.

    Args:
        url (`str`): the server's URL, e.g. ``http://127.0.0.1:30000``.
        version (`str`, *optional*, defaults to ``"0.5.23"``): the server's SGLang version,
            which picks request field names and the weight-update protocol; ``"auto"`` reads it
            from ``/server_info`` once.
        tp_size (`int`, *optional*): TP ranks to send tensor payloads for; read from
            ``/server_info`` when not given.
        weight_bucket_bytes (`int`, *optional*, defaults to 256 MiB): the merged fallback sends
            base weights in requests of at most this many tensor bytes (a larger tensor goes alone).
        checksums (`bool`, *optional*, defaults to `True`): send per-tensor SHA-256 with tensor
            loads (0.5.16+; older servers drop the field unread), so SGLang refuses bytes that
            differ on arrival. 0.5.16-0.5.23 refuse by their scheduler raising, which takes the
            server down: torn bytes are never served.
        api_key (`str`, *optional*): ``--api-key``/``--admin-api-key``; defaults to env ``SGLANG_API_KEY``.
            Never logged, shown in ``repr`` or pickled (see :class:`HTTPEngine`).
        api_key_env (`str`, *optional*): the environment variable holding the key (required then),
            read again wherever the client is unpickled.
        same_host (`bool`, *optional*): whether the server reads this host's files; defaults to
            True for loopback URLs.
        timeout, retries, transport, async_transport: see :class:`HTTPEngine`.

    Raises:
        ConfigError: a malformed ``version`` or non-positive ``tp_size``/``weight_bucket_bytes``.

    Example:
        >>> engine = SGLangEngine("http://127.0.0.1:30000")  # doctest: +SKIP
        >>> engine.preflight(adapter)  # doctest: +SKIP
        >>> engine.load_adapter_tensors("policy@v3", adapter)  # doctest: +SKIP
    """

    kind: ClassVar[str] = "sglang"
    api_key_env = "SGLANG_API_KEY"

    def __init__(
        self,
        url: str,
        *,
        version: str = DEFAULT_VERSION,
        tp_size: int | None = None,
        weight_bucket_bytes: int = 256 << 20,
        checksums: bool = True,
        api_key: str | None = None,
        api_key_env: str | None = None,
        same_host: bool | None = None,
        timeout: float = 60.0,
        retries: RetryPolicy | int | None = None,
        transport: httpx.BaseTransport | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(
            url,
            api_key=api_key,
            api_key_env=api_key_env,
            timeout=timeout,
            retries=retries,
            transport=transport,
            async_transport=async_transport,
        )
        self._version: tuple[int, ...] | None = None if version == "auto" else parse_version(version)
        if tp_size is not None and tp_size < 1:
            raise ConfigError(f"tp_size must be >= 1, got {tp_size}")
        if weight_bucket_bytes < 1:
            raise ConfigError(f"weight_bucket_bytes must be >= 1, got {weight_bucket_bytes}")
        self._tp_size = tp_size
        self._session_open = False  # a weight-update session opened by begin_weight_update
        self.weight_bucket_bytes = weight_bucket_bytes
        self.checksums = checksums
        self.same_host = is_same_host(self.url, same_host)
        self._known: dict[str, str] = {}  # loaded_adapters of the last LoRA answer (pre-0.5.10 listing)
        self._protocol: str | None = None  # how the server takes tensors, read from its routes once
        self._protocol_known = False
        self._streaming: dict[str, bool] = {}  # streamed loads in progress (see .tensors)
        # SGLang allows one weight-update session at a time: this process's clients of the server
        # take turns (streamed loads, merged updates), so concurrent loads queue instead of failing.
        self._gate = SessionGate.for_url(self.url)
        self._cancelled: set[str] = set()  # async loads whose caller was cancelled: stop and undo

    # -- public sync API -------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        """What the server supports, from ``/server_info``.

        Raises:
            EngineUnavailableError, EngineProtocolError, AuthenticationError.
        """
        return self._run(self._capabilities_op())

    def preflight(self, adapter: Adapter) -> None:
        """Refuse, before any bytes move, an adapter this server would reject or serve wrongly
        when loaded from disk (tensor loads pad mixed ranks themselves).

        Raises:
            LoraNotEnabledError, CapabilityError (dp > 1 or several tokenizer workers),
            RankTooLargeError, IncompatibleAdapterError.
        """
        self._run(self._preflight_op(adapter))

    def check_adapter(self, adapter: Adapter, caps: Capabilities) -> None:
        """SGLang's refusals for every LoRA route (the publisher calls it before any bytes move):
        the generic checks of ``caps``, then :mod:`lorasync.engines.sglang.rules` (scaling,
        q/k/v and gate/up packing, no MoE router LoRA, expert LoRA only on a server targeting
        gate_up_proj and down_proj). Mixed ranks pass: tensor loads pad them, and a disk load
        refuses them from the directory's ``adapter_config.json`` before sending.

        Raises:
            LoraNotEnabledError, RankTooLargeError, IncompatibleAdapterError.
        """
        super().check_adapter(adapter, caps)
        rules.check(adapter, url=self.url, pads=True, served=caps.target_modules)

    def load_adapter(self, name: str, path: str | os.PathLike[str], *, pinned: bool = False) -> None:
        """Load the PEFT adapter directory ``path`` (as the server sees it) under ``name``.

        Raises:
            AdapterAlreadyLoadedError, AdapterNotFoundError, RankTooLargeError,
            IncompatibleAdapterError, CapacityError, LoraNotEnabledError, AdapterRejectedError.
        """
        self._run(self._load_op(name, str(path), pinned), adapter=name)

    def load_adapter_tensors(self, name: str, adapter: Adapter, *, pinned: bool = False) -> None:
        """Load ``adapter`` under ``name`` with no files, through the protocol the server offers:
        ``/load_lora_adapter_from_tensors`` (0.5.10-0.5.23) or, on SGLang main, registration
        and a weight-update stream (one session, always closed; a failed stream unregisters the
        name, so it never serves zero or partial weights).

        Runs :meth:`preflight` first; ranks are padded to one ``r`` (exact, see
        :func:`lorasync.transforms.pad_ranks`).

        Raises:
            CapabilityError (no tensor route: a server older than 0.5.10), ConfigError (a
            streamed name containing ':'), AdapterRejectedError (the stream was refused), the
            errors of :meth:`preflight` and of :meth:`load_adapter`.
        """
        gate = self._gate if self._opens_sessions() else None
        if gate is not None:
            gate.acquire_sync()
        try:
            self._run(self._load_tensors_op(name, adapter, pinned), adapter=name)
        except BaseException:
            if name in self._streaming:  # interrupted (KeyboardInterrupt) mid-stream
                self._run(self._stream_abort_op(name, None), adapter=name)
            raise
        finally:
            if gate is not None:
                gate.release()

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name``; SGLang refuses new requests on it at once and answers only
        after its in-flight requests have finished (size ``timeout`` for the longest one).

        Raises:
            AdapterNotFoundError: ``name`` is not loaded.
        """
        self._run(self._unload_op(name), adapter=name)

    def list_adapters(self) -> list[str]:
        """Adapter names served now (``/v1/models`` cards with a ``parent``)."""
        return self._run(self._list_op())

    def adapters_in_use(self) -> frozenset[str] | None:
        """``None``: SGLang 0.5.23 reports no per-adapter request counts on any route (its
        registry counts them in the tokenizer process only). Its unload drains instead: it
        waits for the adapter's in-flight requests before unloading."""
        return None

    async def aadapters_in_use(self) -> frozenset[str] | None:
        return None

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace base weights in place (HF parameter names), in buckets, inside one
        weight-update session on 0.5.23+.

        Raises:
            EngineError: the server refused (message says why); the session is closed.
        """
        gate = None if self._session_open else self._gate  # inside the caller's own session: no new one
        if gate is not None:
            gate.acquire_sync()
        try:
            self._run(self._update_weights_op(named_tensors))
        finally:
            if gate is not None:
                gate.release()

    def begin_weight_update(self) -> None:
        """Open one weight-update session (0.5.23+) for a series of :meth:`update_weights`
        buckets, so no request sees half of a merged update."""
        self._run(self._session_op(True))

    def end_weight_update(self) -> None:
        """Close the session opened by :meth:`begin_weight_update` (no-op when none is open)."""
        self._run(self._session_op(False))

    async def abegin_weight_update(self) -> None:
        await self._arun(self._session_op(True))

    async def aend_weight_update(self) -> None:
        await self._arun(self._session_op(False))

    def update_weights_from_disk(self, path: str | os.PathLike[str], *, weight_version: str | None = None) -> None:
        """Reload all base weights from the checkpoint directory ``path`` (as the server sees it).

        Raises:
            EngineError: the server could not load them (it keeps its old weights).
        """
        self._run(self._update_from_disk_op(str(path), weight_version))

    def generate(
        self,
        input_ids: list[int],
        *,
        lora_name: str | None = None,
        max_new_tokens: int = 16,
        return_logprob: bool = False,
    ) -> GenerateResult:
        """Greedy ``/generate`` for one prompt, with adapter ``lora_name`` (None: the base model).

        Raises:
            AdapterNotFoundError: ``lora_name`` was never loaded.
            LoraNotEnabledError, EngineError: other refusals.
        """
        return self._run(self._generate_op(input_ids, lora_name, max_new_tokens, return_logprob), adapter=lora_name)

    def greedy(self, name: str | None, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy tokens and their log-probs (verification probes); ``name`` None is the base."""
        return self._run(self._greedy_op(name, prompt_ids, max_tokens), adapter=name)

    # -- async twins: the same operations, driven by the async client -----------------------

    async def agreedy(self, name: str | None, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        return await self._arun(self._greedy_op(name, prompt_ids, max_tokens), adapter=name)

    async def acapabilities(self) -> Capabilities:
        return await self._arun(self._capabilities_op())

    async def apreflight(self, adapter: Adapter) -> None:
        await self._arun(self._preflight_op(adapter))

    async def aload_adapter(self, name: str, path: str | os.PathLike[str], *, pinned: bool = False) -> None:
        await self._arun(self._load_op(name, str(path), pinned), adapter=name)

    async def aload_adapter_tensors(self, name: str, adapter: Adapter, *, pinned: bool = False) -> None:
        # The load runs as a task of its own: a cancellation must not cut a request SGLang may
        # already be handling (a registration that lands after its undo would serve zero weights),
        # so the load is told to stop at its next step, undoes what landed, and only then is the
        # cancellation raised here. Cancelled again meanwhile, the load still finishes its undo.
        load = asyncio.ensure_future(self._gated_load(name, adapter, pinned))
        load.add_done_callback(lambda task: task.cancelled() or task.exception())  # always retrieved
        try:
            await asyncio.shield(load)
        except asyncio.CancelledError:
            if not load.done():
                self._cancelled.add(name)
                try:
                    await load
                except EngineError:
                    pass  # the cancellation is what the caller asked about
            raise

    async def _gated_load(self, name: str, adapter: Adapter, pinned: bool) -> None:
        """One tensor load, holding the server's session gate where the load opens a session."""
        gate = self._gate if self._opens_sessions() else None
        if gate is not None:
            await gate.acquire()
        try:
            await self._arun(self._load_tensors_op(name, adapter, pinned), adapter=name)
        finally:
            self._cancelled.discard(name)
            if gate is not None:
                gate.release()

    async def aunload_adapter(self, name: str) -> None:
        await self._arun(self._unload_op(name), adapter=name)

    async def alist_adapters(self) -> list[str]:
        return await self._arun(self._list_op())

    def adapter_sources(self) -> dict[str, str | None] | None:
        """Each adapter's directory from ``/v1/models`` (None for tensor loads, which SGLang
        lists all alike); None on versions whose ``/v1/models`` lists no adapters."""
        return self._run(self._sources_op())

    async def aadapter_sources(self) -> dict[str, str | None] | None:
        return await self._arun(self._sources_op())

    async def aupdate_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        gate = None if self._session_open else self._gate
        if gate is not None:
            await gate.acquire()
        try:
            await self._arun(self._update_weights_op(named_tensors))
        finally:
            if gate is not None:
                gate.release()

    def _opens_sessions(self) -> bool:
        """A tensor load may open a weight-update session: SGLang main's streamed protocol (or
        a server whose protocol is not read yet)."""
        return not self._protocol_known or self._protocol == STREAMED

    async def aupdate_weights_from_disk(self, path: str | os.PathLike[str], *, weight_version: str | None = None) -> None:
        await self._arun(self._update_from_disk_op(str(path), weight_version))

    async def agenerate(
        self,
        input_ids: list[int],
        *,
        lora_name: str | None = None,
        max_new_tokens: int = 16,
        return_logprob: bool = False,
    ) -> GenerateResult:
        return await self._arun(
            self._generate_op(input_ids, lora_name, max_new_tokens, return_logprob), adapter=lora_name
        )
