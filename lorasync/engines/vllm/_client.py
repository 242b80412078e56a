"""Client for a running vLLM OpenAI server's runtime LoRA routes (tested against vLLM 0.32).

What the server needs: ``--enable-lora`` (with ``--max-lora-rank`` at least the adapters' rank),
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` in its environment and ``--api-server-count 1``.
``VLLM_SERVER_DEV_MODE=1`` additionally lets lorasync read the max rank from ``/server_info``
and reach a lorasync worker extension through ``/collective_rpc``.

Quirks handled here (see docs/engines/vllm.md):

* Success is a plain-text 200 with no content type; errors are ``{"error": {...}}`` (flat
  ``{"message": ...}`` before vLLM 0.10.1, ``{"detail": ...}`` from FastAPI itself). Bodies are
  read with ``body_json``/``body_text``, never ``.json()``.
* Load failures come back as 400/404/500 whose only stable part is the message text; they are
  mapped to typed errors by status and substring.
* A 200 without vLLM's ``Success: ...`` text (empty, a proxy's page, a JSON error) counts only
  once ``/v1/models`` confirms it; otherwise the load (or unload) is an ``EngineProtocolError``.
* A retried load answered "already been loaded" is our earlier attempt having landed (lorasync
  loads unique versioned names): it counts as success once ``/v1/models`` confirms the path.
* ``load_inplace=True`` is persisted by vLLM 0.32 and re-reads the files on every step (a
  warning there; 0.33 fixed it, but the swap still lands under running requests); it is off
  unless asked for, and ``capabilities().load_inplace`` is False.
* Before 0.34 vLLM tells ``LoRARequest``s apart by name alone: a name this client unloaded is
  loaded again only once no request of the unloaded version runs (``_releases``).

The module is longer than the house's ~400 lines because it is one class whose public methods
come in sync/async pairs with full docstrings; the operations behind them are written once.
Error mapping lives in ``_errors``, body parsing in ``_bodies``, routes and specs in ``_protocol``.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import httpx

from lorasync.runtime._retry import RetryPolicy
from lorasync.wire.d2h import to_shm_segment
from lorasync.engines._engine import Capabilities
from lorasync.engines._hosts import is_same_host
from lorasync.engines._http import Call, HTTPEngine, Operation, body_json, body_text
from lorasync.engines.vllm import _releases
from lorasync.engines.vllm._bodies import Completion, adapter_roots, completion_of, lora_in_use, router_workers, shown_url
from lorasync.engines.vllm._lora_compat import rules_for
from lorasync.engines.vllm.moe import check as check_moe
from lorasync.engines.vllm._errors import dig, disabled, engine_dead, generic, load_error, message_of, route_missing, unexpected
from lorasync.engines.vllm._protocol import (
    COMPLETIONS_ROUTE,
    CONFIG_KEY,
    CUDA_UPDATES,
    FUSED_MODULES,
    IPC_PREFIX,
    LIST_WORKERS_ROUTE,
    LOAD_ROUTE,
    METRICS_ROUTE,
    RUNTIME_ENV,
    MODELS_ROUTE,
    RPC_ROUTE,
    SERVER_INFO_ROUTE,
    UNLOAD_ROUTE,
    WORKER_EXTENSION,
    NO_STAGE,
    CudaStage,
    ShmStage,
    one_cuda_device,
    ping_features,
    write_stage_file,
)
from lorasync.engines._versions import check_engine_version
from lorasync.errors import (
    AdapterNotFoundError,
    CapabilityError,
    ConfigError,
    EngineError,
    EngineProtocolError,
    ReplicatedEngineError,
)

if TYPE_CHECKING:
    import torch

    from lorasync.adapter._adapter import Adapter

__all__ = ["Completion", "VLLMEngine"]  # Completion lives in _bodies; re-exported here



class VLLMEngine(HTTPEngine):
    """Load, unload and list LoRA adapters on a vLLM OpenAI server.

    Args:
        url (`str`, defaults to ``"http://127.0.0.1:8000"``): the server's URL. It may carry
            ``user:password@`` (basic auth) and a ``?query`` (sent with every request); both are
            secrets, like the key.
        api_key (`str`, *optional*): the server's ``--api-key``; defaults to ``$VLLM_API_KEY``.
            Never logged, shown in ``repr`` or pickled (an unpickled client refuses to send until
            given it; use ``api_key_env`` to have it read again there).
        api_key_env (`str`, *optional*): the environment variable holding the key (required then),
            read where the client is built and again wherever it is unpickled.
        timeout (`float`): seconds per request; a load reads and validates the adapter first.
        retries (`RetryPolicy | int | None`): retries of connection errors and 502/503/504.
        max_rank (`int`, *optional*): the server's ``--max-lora-rank``, reported by
            ``capabilities()`` when the server does not expose it (no dev mode).
        max_loras (`int`, *optional*): the server's ``--max-loras``, likewise.
        same_host (`bool`, *optional*): whether the server reads this host's files; defaults to
            True for loopback URLs.
        transport / async_transport: custom ``httpx`` transports (tests).

    Example:
        >>> engine = VLLMEngine("http://127.0.0.1:8000")  # doctest: +SKIP
        >>> engine.load_adapter("policy@v3", "/dev/shm/lorasync/policy/v3")  # doctest: +SKIP
        >>> engine.list_adapters()  # doctest: +SKIP
        ['policy@v3']
    """

    kind: ClassVar[str] = "vllm"
    api_key_env: ClassVar[str] = "VLLM_API_KEY"
    #: Worker-extension method (``LoraSyncWorkerExtension.lorasync_ping``) that answers a truthy
    #: value on every worker when lorasync's extension is loaded.
    worker_extension_probe: ClassVar[str] = "lorasync_ping"
    #: Worker-extension method taking a merged bucket from this host's GPU (CUDA IPC).
    _cuda_update_method: ClassVar[str] = "lorasync_update_weights_cuda"
    remedies: ClassVar[Mapping[str, str]] = {
        "lora": "restart the vLLM server with --enable-lora (and --max-lora-rank >= the adapter's rank)",
        "runtime_lora": f"restart the vLLM server with {RUNTIME_ENV}=1 in its environment (and --api-server-count 1)",
        "tensor_load": f"restart the vLLM server with VLLM_SERVER_DEV_MODE=1 in its environment and --worker-extension-cls "
        f"{WORKER_EXTENSION} (lorasync importable by the server's Python), or publish with transport='disk'",
        "weight_update": f"restart the vLLM server with VLLM_SERVER_DEV_MODE=1 in its environment and --worker-extension-cls "
        f"{WORKER_EXTENSION} (lorasync importable by the server's Python)",
        "same_host": "pass a root= (CLI --root) on a filesystem the server sees at the same path, or same_host=True if it "
        "already does",
    }

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        *,
        api_key: str | None = None,
        api_key_env: str | None = None,
        timeout: float = 60.0,
        retries: RetryPolicy | int | None = None,
        max_rank: int | None = None,
        max_loras: int | None = None,
        same_host: bool | None = None,
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
        self.max_rank = max_rank
        self.max_loras = max_loras
        self.same_host = is_same_host(self.url, same_host)
        self._ipc_tokens: dict[str, str] = {}  # adapter name -> token of tensors staged in the workers
        self._one_trip_misses = 0  # GPU loads in a row whose workers could not read the stage file
        # Merged buckets on a GPU go by CUDA IPC where every worker's ping named the method (None:
        # not probed yet), until a worker cannot map them.
        self._cuda_updates: bool | None = None
        self._unloaded: set[str] = set()  # names this client unloaded (requests of them may still run)

    # -- public API: each operation written once, driven sync and async ---------------------------

    def capabilities(self) -> Capabilities:
        """Probe the server: LoRA on, runtime routes on, max rank/slots, worker extension.

        Returns:
            `Capabilities`: ``max_rank``/``max_loras`` come from ``/server_info`` in dev mode,
            else from the constructor (None when unknown).

        Raises:
            AuthenticationError, EngineUnavailableError, EngineError.
        """
        return self._run(self._capabilities())

    async def acapabilities(self) -> Capabilities:
        return await self._arun(self._capabilities())

    def check_adapter(self, adapter: Adapter, caps: Capabilities) -> None:
        """The generic checks, then vLLM's MoE rules (:mod:`lorasync.engines.vllm.moe`: every expert
        of a layer with all three projections, one rank per projection). This client sends
        per-expert MoE LoRA, the format every vLLM loads.

        Raises:
            LoraNotEnabledError, RankTooLargeError, IncompatibleAdapterError.
        """
        super().check_adapter(adapter, caps)
        check_moe(adapter, caps, moe_lora_format="per_expert")

    def load_adapter(self, name: str, path: str | os.PathLike[str], *, load_inplace: bool = False) -> None:
        """Load the PEFT adapter directory ``path`` (on the server's host) under ``name``.

        Returns once vLLM has read and validated the adapter. Keep the files until the name is
        unloaded: vLLM re-reads them when an evicted adapter is requested again.

        Args:
            name (`str`): the name requests select with ``model=name``; use a new versioned
                name per version.
            path (`str | os.PathLike`): a local directory; made absolute (vLLM would treat a
                relative path that it cannot find as a Hugging Face repo id and download it).
            load_inplace (`bool`, defaults to `False`): replace an already loaded ``name``.
                On vLLM 0.32 the flag sticks and the files are re-read on every step; deleting
                them then crashes the engine. Prefer versioned names.

        Raises:
            AdapterAlreadyLoadedError: ``name`` is loaded and ``load_inplace`` is False.
            AdapterNotFoundError: no adapter at ``path`` (or no weights in it).
            RankTooLargeError: the adapter's rank exceeds the server's ``--max-lora-rank``.
            IncompatibleAdapterError: DoRA, bias, unknown modules or tensor names, or ``name``
                equals the base model's name.
            LoraNotEnabledError: the server runs without ``--enable-lora``.
            RuntimeLoraDisabledError: the server runs without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``.
            AuthenticationError, EngineUnavailableError, EngineError.
        """
        self._run(self._load(name, path, load_inplace), adapter=name)

    async def aload_adapter(self, name: str, path: str | os.PathLike[str], *, load_inplace: bool = False) -> None:
        await self._arun(self._load(name, path, load_inplace), adapter=name)

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name`` (new requests for it get 404).

        vLLM 0.32 only forgets the name: the weights stay in the engine's LoRA cache until
        evicted, so memory is not freed.

        Raises:
            AdapterNotFoundError: ``name`` is not loaded.
            RuntimeLoraDisabledError, AuthenticationError, EngineUnavailableError, EngineError.
        """
        self._run(self._unload(name), adapter=name)

    async def aunload_adapter(self, name: str) -> None:
        await self._arun(self._unload(name), adapter=name)

    def adapters_in_use(self) -> frozenset[str] | None:
        """Adapter names that running or waiting requests use, from vLLM's ``/metrics`` gauge
        ``vllm:lora_requests_info`` (its ``running_lora_adapters`` and ``waiting_lora_adapters``).

        vLLM refreshes the gauge with every batch of outputs, so it lags by up to one engine step
        and does not see a request still being tokenised in the API server; with data-parallel
        engines or several API servers it describes only one engine (vLLM warns about it).

        Returns:
            `frozenset[str] | None`: the union of running and waiting names of the newest sample;
            ``None`` when the server publishes no such gauge (LoRA off, metrics not exposed).

        Raises:
            AuthenticationError, EngineUnavailableError, EngineError.
        """
        return self._run(self._in_use())

    async def aadapters_in_use(self) -> frozenset[str] | None:
        return await self._arun(self._in_use())

    def load_adapter_tensors(self, name: str, adapter: Adapter) -> None:
        """Load ``adapter`` as ``name`` without files: through CUDA IPC when its tensors are on one
        GPU and the server is on this host (the workers copy them out of the trainer's GPU
        memory), else through shared memory (GPU tensors reach it in one transfer).

        Needs the lorasync worker extension (``--worker-extension-cls
        lorasync.engines.vllm_worker.LoraSyncWorkerExtension``) and ``VLLM_SERVER_DEV_MODE=1``;
        the name is registered through the normal load route, so OpenAI requests can select it.

        Raises:
            CapabilityError-like ``EngineError`` when the extension is missing, plus everything
            :meth:`load_adapter` raises.
        """
        self._run(self._load_tensors(name, adapter), adapter=name)

    async def aload_adapter_tensors(self, name: str, adapter: Adapter) -> None:
        await self._arun(self._load_tensors(name, adapter), adapter=name)

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace base weights (HF names) through the worker extension, from shared memory.

        Call between :meth:`begin_weight_update` and :meth:`end_weight_update`; a fused weight
        (q/k/v, gate/up) must arrive whole in one call.
        """
        self._run(self._update_weights(named_tensors))

    async def aupdate_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        await self._arun(self._update_weights(named_tensors))

    def begin_weight_update(self) -> None:
        """Pause generation (in-flight requests finish first) before merged weight updates."""
        self._run(self._pause())

    async def abegin_weight_update(self) -> None:
        await self._arun(self._pause())

    def end_weight_update(self) -> None:
        """Drop prefix-cache blocks computed with the old weights and resume generation."""
        self._run(self._resume())

    async def aend_weight_update(self) -> None:
        await self._arun(self._resume())

    def list_adapters(self) -> list[str]:
        """Names of the LoRA adapters the server serves now (``/v1/models`` cards with a parent)."""
        return self._run(self._list())

    async def alist_adapters(self) -> list[str]:
        return await self._arun(self._list())

    def adapter_sources(self) -> dict[str, str | None]:
        """Each served adapter's ``lora_path`` from ``/v1/models``: the directory it was loaded
        from, or for a tensor (IPC) load a staging token unique to that load."""
        return self._run(self._roots())

    async def aadapter_sources(self) -> dict[str, str | None]:
        return await self._arun(self._roots())

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        *,
        model: str,
        max_tokens: int = 8,
        logprobs: int | None = 1,
        ignore_eos: bool = True,
    ) -> Completion:
        """Greedy completion (temperature 0) of a token-id prompt through ``/v1/completions``.

        Used to verify a published adapter against the trainer's reference.

        Args:
            prompt_token_ids (`Sequence[int]`): the prompt, already tokenized.
            model (`str`): an adapter name (or the base model's served name).
            max_tokens (`int`): tokens to generate.
            logprobs (`int`, *optional*, defaults to 1): top-k logprobs per step; None for none.
            ignore_eos (`bool`, defaults to `True`): always generate ``max_tokens`` tokens.

        Returns:
            `Completion`: generated token ids, their logprobs and the top-k per step.

        Raises:
            AdapterNotFoundError: the server serves no model or adapter named ``model``.
            AuthenticationError, EngineUnavailableError, EngineProtocolError, EngineError.
        """
        return self._run(self._generate(prompt_token_ids, model, max_tokens, logprobs, ignore_eos), adapter=model)

    async def agenerate(
        self,
        prompt_token_ids: Sequence[int],
        *,
        model: str,
        max_tokens: int = 8,
        logprobs: int | None = 1,
        ignore_eos: bool = True,
    ) -> Completion:
        return await self._arun(
            self._generate(prompt_token_ids, model, max_tokens, logprobs, ignore_eos), adapter=model
        )

    def greedy(self, name: str | None, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy tokens after ``prompt_ids`` with adapter ``name`` (None: the base model) and each
        chosen token's log-probability; the verification probe's view of :meth:`generate`.

        Raises:
            AdapterNotFoundError, AuthenticationError, EngineUnavailableError, EngineError.
        """
        return self._run(self._greedy(name, prompt_ids, max_tokens), adapter=name)

    async def agreedy(self, name: str | None, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        return await self._arun(self._greedy(name, prompt_ids, max_tokens), adapter=name)

    # -- operations (no I/O: yield a Call, receive its httpx.Response) -----------------------------

    def _capabilities(self) -> Operation[Capabilities]:
        # GET on a POST-only route: 405 when registered, 404 when runtime updating is off.
        route = yield Call("GET", LOAD_ROUTE)
        if route.status_code >= 500 and engine_dead(message_of(route)):
            raise generic(self, route, LOAD_ROUTE, None, message_of(route), "the check of the runtime LoRA route")
        # A router forwards the route check, /server_info and /version to one of its servers (seen
        # with vllm-router 0.1.17), so only its own worker list tells it from one vLLM: asked always.
        yield from self._refuse_router()
        if route.status_code not in (404, 405):
            raise unexpected(self, route, LOAD_ROUTE, None, EngineProtocolError, "the check of the runtime LoRA route")
        runtime_lora = route.status_code == 405
        if not runtime_lora and self.url.endswith("/v1"):
            # The OpenAI base URL (".../v1", what OpenAI clients take): every route lorasync asks
            # for then lands on /v1/v1/..., and each would look switched off. Said once, here.
            models = yield Call("GET", MODELS_ROUTE.removeprefix("/v1"))
            if models.status_code == 200:
                root = self.url.removesuffix("/v1")
                raise ConfigError(
                    f"{self.kind} engine URL {self.url} ends in /v1, the OpenAI API's base URL; lorasync adds vLLM's "
                    f"route paths itself: drop the /v1 (vllm:{root})"
                )

        lora, max_rank, max_loras, targets, extension_cls, moe_3d = True, self.max_rank, self.max_loras, None, "", False
        info = yield Call("GET", SERVER_INFO_ROUTE, params={"config_format": "json"})
        config = dig(body_json(info), "vllm_config") if info.status_code == 200 else None
        if isinstance(config, dict):  # dev mode: the server's own config is authoritative
            lora_config = config.get("lora_config")
            lora = isinstance(lora_config, dict)
            if isinstance(lora_config, dict):
                max_rank = lora_config.get("max_lora_rank", max_rank)
                # The worker's LRU holds max_cpu_loras adapters (>= max_loras GPU slots).
                max_loras = lora_config.get("max_cpu_loras") or lora_config.get("max_loras", max_loras)
                if lora_config.get("target_modules"):
                    targets = frozenset(lora_config["target_modules"])
                moe_3d = lora_config.get("enable_mixed_moe_lora_format") is True
            extension_cls = dig(config, "parallel_config", "worker_extension_cls") or ""

        extension = False
        if isinstance(config, dict) and extension_cls:
            extension = yield from self._has_worker_extension()

        version_response = yield Call("GET", "/version")
        version = dig(body_json(version_response), "version") if version_response.status_code == 200 else None
        notes = [
            f"vllm {version or 'unknown version'}",
            *_releases.notes(rules_for(version)),
            "keep adapter files until their name is unloaded: an evicted adapter is re-read from disk",
        ]
        notes += check_engine_version("vllm", version, url=self.url)  # refuses an unknown major version
        if not isinstance(config, dict):
            notes.append(
                "max rank/slots not exposed (start the server with VLLM_SERVER_DEV_MODE=1, or pass max_rank=)"
            )
        return Capabilities(
            engine=self.kind,
            url=self.url,
            lora=lora,
            runtime_lora=runtime_lora,
            max_rank=max_rank,
            max_loras=max_loras,
            target_modules=targets,
            tensor_load=extension,
            device_tensors=extension and self.same_host,
            weight_update=extension,
            load_inplace=False,
            reloads_from_path=True,  # the worker LRU re-reads an evicted adapter from its path
            same_host=self.same_host,
            fused_modules=FUSED_MODULES,
            moe_3d=moe_3d,
            version=str(version) if version else None,
            notes=tuple(notes),
        )

    def _refuse_router(self) -> Operation[None]:
        """Raise ReplicatedEngineError where this URL is a router (it lists workers): a load sent
        there would reach one of them (lorasync.engines.vllm.router publishes to each). A route
        that fails to answer says nothing: a proxy in front of one vLLM may not know it."""
        try:
            response = yield Call("GET", LIST_WORKERS_ROUTE, retry=False)
        except EngineError:
            return
        workers = router_workers(response)
        if workers is not None:
            shown = ", ".join(shown_url(w) for w in workers[:4]) + (", ..." if len(workers) > 4 else "")
            raise ReplicatedEngineError(
                f"{self.kind} at {self.url} is a router in front of {len(workers)} server(s) ({shown}): a load sent there "
                "reaches one of them, and requests routed to the others would answer 404 or an older version. "
                f"{self.router_remedy}",
                **self.error_context(LIST_WORKERS_ROUTE, None, response),
            )

    @property
    def router_remedy(self) -> str:
        """What to do instead of giving this client a router's URL (said by :meth:`_refuse_router`)."""
        return (
            f"Publish with 'vllm-router:{self.url}' (connect('vllm-router', url)): lorasync then loads and verifies the "
            "version on every server behind it"
        )

    def _in_use(self) -> Operation[frozenset[str] | None]:
        response = yield Call("GET", METRICS_ROUTE)
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise generic(self, response, METRICS_ROUTE, None, message_of(response), "reading metrics")
        try:
            return lora_in_use(body_text(response))
        except ValueError as exc:
            raise EngineProtocolError(
                f"{self.kind} at {self.url}{METRICS_ROUTE} answered text that is not Prometheus' format ({exc}); "
                "is this a vLLM OpenAI server?",
                **self.error_context(METRICS_ROUTE, None, response),
            ) from exc

    def _has_worker_extension(self) -> Operation[bool]:
        """Hook: True when lorasync's vLLM worker extension answers through ``/collective_rpc``.

        ``/collective_rpc`` exists only with ``VLLM_SERVER_DEV_MODE=1``; the extension is loaded
        with ``--worker-extension-cls`` and must define :attr:`worker_extension_probe` returning a
        truthy value on every worker. Any other answer (404, 500 for a missing method) is False.
        """
        response = yield Call(
            "POST", RPC_ROUTE, json={"method": self.worker_extension_probe, "timeout": 30.0}, retry=False
        )
        results = dig(body_json(response), "results") if response.status_code == 200 else None
        features = ping_features(results)
        self._cuda_updates = features is not None and CUDA_UPDATES in features
        return isinstance(results, list) and bool(results) and all(results)

    def _load(self, name: str, path: str | os.PathLike[str], load_inplace: bool) -> Operation[None]:
        if not name:
            raise ConfigError("adapter name must be a non-empty string")
        lora_path = os.path.abspath(os.fspath(path))
        self.refuse_extra_weights(name, lora_path, LOAD_ROUTE)
        body: dict[str, Any] = {"lora_name": name, "lora_path": lora_path}
        if load_inplace:  # sent only when asked: older servers then refuse instead of ignoring it silently
            body["load_inplace"] = True
            yield from _releases.warn_inplace(self.url, name, lora_path)
        if name in self._unloaded:  # vLLM before 0.34 would take the new LoRA id for the old one's
            yield from _releases.refuse_name_in_use(name, kind=self.kind, url=self.url, in_use=self._in_use)
        response = yield Call("POST", LOAD_ROUTE, json=body)
        if response.status_code == 200 and body_text(response).startswith("Success"):
            self._unloaded.discard(name)
            return
        message = message_of(response)
        if response.status_code == 200:
            # Not vLLM's success text (empty, a proxy's page, a JSON error): only the engine's
            # model list says whether the adapter serves.
            models = yield Call("GET", MODELS_ROUTE)
            served = adapter_roots(models)
            if name in served and served[name] in (None, lora_path):
                return
            raise EngineProtocolError(
                f"{self.kind} at {self.url}{LOAD_ROUTE} answered the load of {name!r} with HTTP 200 but "
                f"{body_text(response)[:200]!r} instead of vLLM's success text, and /v1/models does not list "
                "it; the adapter is not served (is a proxy in front of vLLM rewriting answers?)",
                **self.error_context(LOAD_ROUTE, name, response),
            )
        if "has already been loaded" in message and response.extensions.get("lorasync_attempts", 1) > 1:
            # An earlier attempt of this request reached the server before its connection failed.
            # Success only if the name now serves our path.
            models = yield Call("GET", MODELS_ROUTE)
            served = adapter_roots(models)
            if name in served and served[name] in (None, lora_path):
                return
        raise load_error(self, response, name, lora_path, message)

    def _load_tensors(self, name: str, adapter: Adapter) -> Operation[None]:
        if not name:
            raise ConfigError("adapter name must be a non-empty string")
        token = uuid.uuid4().hex
        config = json.dumps(adapter.config.to_peft().to_dict(), default=sorted)
        staged = False
        if self.same_host and one_cuda_device(adapter.tensors):
            if self._one_trip_misses < 2:  # twice in a row not for these workers: RPC from then on
                landed = yield from self._load_cuda_one_trip(name, token, adapter, config)
                if landed:
                    return
                token = uuid.uuid4().hex  # the RPC stage below starts afresh
            staged = yield from self._stage_cuda(name, token, adapter, config)
        if not staged:
            # CPU tensors are copied in directly; GPU tensors come over in one transfer per device.
            segment = to_shm_segment(adapter.tensors, {CONFIG_KEY: config})
            try:
                spec = ShmStage(shm=segment.name, nbytes=segment.nbytes, token=token).to_json()
                yield from self._rpc("lorasync_stage_adapter", spec, adapter=name)
            finally:
                # Every worker copied the tensors out (or failed): the segment is no longer needed.
                segment.release()
        try:
            yield from self._load(name, IPC_PREFIX + token, False)
        except EngineError:
            # The load may have landed before its answer was lost: the tensors go only once the
            # name is known not to be registered on them (else it would serve nothing once evicted).
            if (yield from self._undo_tensor_load(name, token)):
                yield from self._rpc("lorasync_release_adapter", token, adapter=name, check=False)
            raise
        except BaseException:
            yield from self._rpc("lorasync_release_adapter", token, adapter=name, check=False)
            raise
        yield from self._loaded_on(name, token)

    def _loaded_on(self, name: str, token: str) -> Operation[None]:
        """``name`` now serves the tensors staged under ``token``."""
        # Released on unload. A restarted client cannot know the token: those tensors stay staged
        # in the workers until the engine restarts (documented in docs/engines/vllm.md).
        earlier = self._ipc_tokens.get(name)
        self._ipc_tokens[name] = token
        if earlier is not None and earlier != token:
            # Kept by a failed load of this name that could not be undone; the name is registered
            # on this load's tensors, so the earlier ones serve nothing.
            yield from self._rpc("lorasync_release_adapter", earlier, adapter=name, check=False)

    def _undo_tensor_load(self, name: str, token: str) -> Operation[bool]:
        """After a failed tensor load: read back whether ``name`` is registered on ``token`` and
        unload it if so. True when the staged tensors may go; False when the engine cannot tell
        (unreachable): they stay, and an unload of ``name`` releases them."""
        try:
            served = yield from self._roots()
            if served.get(name) == IPC_PREFIX + token:
                yield from self._unload(name)
        except EngineError:
            self._ipc_tokens.setdefault(name, token)
            return False
        return True

    def _load_cuda_one_trip(self, name: str, token: str, adapter: Adapter, config: str) -> Operation[bool]:
        """Load a GPU adapter in one round trip: its CUDA IPC spec waits in a stage file the
        workers read during the load (``_protocol.write_stage_file``). False, with nothing left
        registered or staged, when the workers could not stage from it (another /dev/shm, another
        user, the GPU not visible, a worker of an older lorasync, an engine restarted since the
        capability probe taught its workers lorasync's paths): the caller stages by RPC."""
        from lorasync.wire.cuda_ipc import share_tensors

        shared = share_tensors(adapter.tensors, {CONFIG_KEY: config})
        path = None
        try:
            path = write_stage_file(CudaStage(token=token, ipc=shared.spec))
            if path is None:
                self._one_trip_misses += 1
                return False
            try:
                yield from self._load(name, IPC_PREFIX + token, False)
            except AdapterNotFoundError:
                self._one_trip_misses += 1  # some worker did not read the file
                # Under tensor parallelism another worker may have staged from it: let it go.
                yield from self._rpc("lorasync_release_adapter", token, adapter=name, check=False)
                return False
            except EngineError as exc:
                if NO_STAGE not in str(exc):
                    # As for a load of RPC-staged tensors: it may have landed before its answer was lost.
                    if (yield from self._undo_tensor_load(name, token)):
                        yield from self._rpc("lorasync_release_adapter", token, adapter=name, check=False)
                    raise
                self._one_trip_misses += 1
                yield from self._rpc("lorasync_release_adapter", token, adapter=name, check=False)
                return False
            except BaseException:
                yield from self._rpc("lorasync_release_adapter", token, adapter=name, check=False)
                raise
        finally:
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            # Every worker has its own copy (or failed): the trainer's buffer can go.
            shared.release()
        self._one_trip_misses = 0
        yield from self._loaded_on(name, token)
        return True

    def _stage_cuda(self, name: str, token: str, adapter: Adapter, config: str) -> Operation[bool]:
        """Hand the adapter's GPU tensors to every worker through CUDA IPC; False when some
        worker cannot map them (no CUDA, another GPU set), after undoing any partial staging."""
        from lorasync.wire.cuda_ipc import share_tensors

        shared = share_tensors(adapter.tensors, {CONFIG_KEY: config})
        try:
            spec = CudaStage(token=token, ipc=shared.spec).to_json()
            results = yield from self._rpc("lorasync_stage_adapter_cuda", spec, adapter=name)
        finally:
            # Every worker has its own copy (or failed): the trainer's buffer can go.
            shared.release()
        if results and all(isinstance(r, dict) and r.get("staged") is True for r in results):
            return True
        yield from self._rpc("lorasync_release_adapter", token, adapter=name, check=False)
        return False

    def _update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> Operation[None]:
        if self.same_host and one_cuda_device(named_tensors) and self._cuda_updates is None:
            yield from self._has_worker_extension()  # which worker methods there are, once
        if self.same_host and self._cuda_updates and one_cuda_device(named_tensors):
            # A bucket folded on this host's GPU goes to the workers' GPUs device to device.
            from lorasync.wire.cuda_ipc import share_tensors

            shared = share_tensors(named_tensors, {})
            try:
                # Called only where every worker's ping named it (an older worker has no such
                # method, and vLLM 0.32 drops the connection on one); an error answer falls back
                # below, like a worker that cannot map the memory.
                results = yield from self._rpc(self._cuda_update_method, json.dumps(shared.spec), adapter=None, check=False)
            finally:
                shared.release()  # every worker has its own copy (or failed)
            if results and all(isinstance(r, dict) and r.get("staged") is True for r in results):
                return
            # Some worker cannot map this GPU (or is of an older lorasync): this bucket and every
            # later one go through shared memory, which also rewrites the workers that took it.
            self._cuda_updates = False
        segment = to_shm_segment(named_tensors)
        try:
            spec = ShmStage(shm=segment.name, nbytes=segment.nbytes).to_json()
            yield from self._rpc("lorasync_update_weights", spec, adapter=None)
        finally:
            segment.release()

    def _pause(self) -> Operation[None]:
        response = yield Call("POST", "/pause", params={"mode": "wait"}, retry=False)
        if response.status_code != 200:
            raise generic(self, response, "/pause", None, message_of(response), "pausing generation (needs VLLM_SERVER_DEV_MODE=1)")

    def _resume(self) -> Operation[None]:
        response = yield Call("POST", "/reset_prefix_cache")
        if response.status_code != 200:
            raise generic(self, response, "/reset_prefix_cache", None, message_of(response), "resetting the prefix cache")
        response = yield Call("POST", "/resume")
        if response.status_code != 200:
            raise generic(self, response, "/resume", None, message_of(response), "resuming generation")

    def _rpc(self, method: str, arg: str, *, adapter: str | None, check: bool = True) -> Operation[list[Any]]:
        """Call a worker-extension method on every worker (``/collective_rpc``; args are strings)."""
        response = yield Call("POST", RPC_ROUTE, json={"method": method, "args": [arg]}, retry=False)
        results = dig(body_json(response), "results") if response.status_code == 200 else None
        if check and not isinstance(results, list):
            if response.status_code == 404:
                raise CapabilityError(
                    f"{self.kind} at {self.url} has no /collective_rpc: start it with VLLM_SERVER_DEV_MODE=1 and "
                    f"--worker-extension-cls {WORKER_EXTENSION} (or use transport='disk')",
                    **self.error_context(RPC_ROUTE, adapter, response),
                )
            raise generic(self, response, RPC_ROUTE, adapter, message_of(response), f"worker call {method}")
        return results if isinstance(results, list) else []

    def _unload(self, name: str) -> Operation[None]:
        if not name:
            raise ConfigError("adapter name must be a non-empty string")
        response = yield Call("POST", UNLOAD_ROUTE, json={"lora_name": name})
        if response.status_code == 200 and not body_text(response).startswith("Success"):
            # Not vLLM's success text: believe the model list (a JSON error or empty 200 from a
            # proxy must not count as an unload that did not happen).
            after = yield Call("GET", MODELS_ROUTE)
            if after.status_code != 200 or name in adapter_roots(after):
                raise EngineProtocolError(
                    f"{self.kind} at {self.url}{UNLOAD_ROUTE} answered the unload of {name!r} with HTTP 200 but "
                    f"{body_text(response)[:200]!r}, and the adapter is still listed; call unload_adapter again",
                    **self.error_context(UNLOAD_ROUTE, name, response),
                )
        if response.status_code == 200:
            self._unloaded.add(name)
            token = self._ipc_tokens.pop(name, None)
            if token is not None:
                # Tensors staged in the workers for this name are no longer reachable by requests.
                yield from self._rpc("lorasync_release_adapter", token, adapter=name, check=False)
            return
        if route_missing(response):
            raise disabled(self, response, UNLOAD_ROUTE, name)
        message = message_of(response)
        if response.status_code == 404 or "cannot be found" in message:
            raise AdapterNotFoundError(
                f"{self.kind} at {self.url} does not serve adapter {name!r}; list_adapters() shows what it serves",
                **self.error_context(UNLOAD_ROUTE, name, response),
            )
        raise generic(self, response, UNLOAD_ROUTE, name, message, f"unload of adapter {name!r}")

    def _list(self) -> Operation[list[str]]:
        return list((yield from self._roots()))

    def _roots(self) -> Operation[dict[str, str | None]]:
        response = yield Call("GET", MODELS_ROUTE)
        if response.status_code != 200:
            raise generic(self, response, MODELS_ROUTE, None, message_of(response), "listing models")
        if dig(body_json(response), "data") is None:
            raise unexpected(self, response, MODELS_ROUTE, None, EngineProtocolError, "listing models")
        return adapter_roots(response)

    def _greedy(
        self, name: str | None, prompt_ids: Sequence[int], max_tokens: int
    ) -> Operation[tuple[list[int], list[float]]]:
        model = name
        if model is None:
            response = yield Call("GET", MODELS_ROUTE)
            cards = dig(body_json(response), "data") if response.status_code == 200 else None
            bases = [c.get("id") for c in cards or [] if isinstance(c, dict) and not c.get("parent")]
            if not bases or not isinstance(bases[0], str):
                raise unexpected(self, response, MODELS_ROUTE, None, EngineProtocolError, "listing the base model")
            model = bases[0]
        completion = yield from self._generate(prompt_ids, model, max_tokens, 1, True)
        return list(completion.token_ids), list(completion.logprobs or ())

    def _generate(
        self, prompt: Sequence[int], model: str, max_tokens: int, logprobs: int | None, ignore_eos: bool
    ) -> Operation[Completion]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": [int(t) for t in prompt],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": ignore_eos,
            "return_token_ids": True,
        }
        if logprobs is not None:
            body["logprobs"] = logprobs
            body["return_tokens_as_token_ids"] = True  # logprob keys become "token_id:<id>"
        response = yield Call("POST", COMPLETIONS_ROUTE, json=body)
        if response.status_code != 200:
            message = message_of(response)
            if response.status_code == 404 and "does not exist" in message:
                raise AdapterNotFoundError(
                    f"{self.kind} at {self.url} serves no model or adapter named {model!r}; "
                    "load it first or check list_adapters()",
                    **self.error_context(COMPLETIONS_ROUTE, model, response),
                )
            raise generic(self, response, COMPLETIONS_ROUTE, model, message, f"completion with model {model!r}")
        choice = dig(body_json(response), "choices", 0)
        if not isinstance(choice, dict):
            raise unexpected(self, response, COMPLETIONS_ROUTE, model, EngineProtocolError, "completion")
        completion = completion_of(choice, model, logprobs is not None)
        if completion is None:
            raise unexpected(self, response, COMPLETIONS_ROUTE, model, EngineProtocolError, "completion token ids")
        return completion


# -- helpers --------------------------------------------------------------------------------------


