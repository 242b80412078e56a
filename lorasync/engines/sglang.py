"""The SGLang engine client: runtime LoRA load/unload over HTTP, tensor loads, merged fallback.

Every operation is written once as a sans-IO generator (see :mod:`lorasync.engines._http`) and
driven sync or async. What this client knows about SGLang (0.5.23 unless ``version=`` says
otherwise; see ``docs/engines/sglang.md``):

* LoRA routes answer ``{"success", "error_message", "loaded_adapters"}`` with 200 or 400; the
  error text is the only discriminator, so it is matched here, once, into typed errors.
* The capability gate is ``/server_info`` (``/get_server_info`` on older servers): ``enable_lora``,
  ``max_lora_rank``, ``lora_target_modules`` (SGLang compares *packed* names: ``q_proj`` covers
  ``k_proj`` and ``v_proj`` too), ``max_loaded_loras``, ``dp_size``, ``tokenizer_worker_num``.
* SGLang scales every module by ``lora_alpha / r`` and ignores ``use_rslora``, ``rank_pattern``
  and ``alpha_pattern``; it packs q/k/v and gate/up and needs ``q_proj`` and ``v_proj`` wherever
  any of q/k/v is adapted, and ``gate_proj`` wherever ``up_proj`` is. Such adapters load "fine"
  and serve wrongly (or fail lazily), so :meth:`SGLangEngine.preflight` refuses them up front.
* ``/load_lora_adapter_from_tensors`` takes one ``base64(pickle)`` payload per TP rank
  (``serialized_named_tensors``, 0.5.17+; a single ``serialized_tensors`` string in 0.5.10-0.5.16).
  lorasync sends plain pickles of CPU tensors, which SGLang's allowlisting unpickler reads on any
  host; lorasync itself never unpickles anything.
* A retried load answered "already loaded", or a 200 that is not SGLang's envelope, counts only
  once ``/v1/models`` lists the name with our path (an earlier attempt landed, its answer lost).
* 0.5.23 accepts ``/update_weights_from_tensor`` only inside ``/begin_weight_update`` ...
  ``/end_weight_update``; the session is always closed, also when an update fails.
"""

from __future__ import annotations

import base64
import hashlib
import io
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlsplit

from lorasync._retry import RetryPolicy
from lorasync.engines._base import Capabilities
from lorasync.engines._http import Call, HTTPEngine, Operation, body_json, body_text
from lorasync.engines._versions import check_engine_version
from lorasync.errors import (
    AdapterAlreadyLoadedError,
    AdapterNotFoundError,
    AdapterRejectedError,
    CapabilityError,
    CapacityError,
    ConfigError,
    EngineError,
    EngineProtocolError,
    IncompatibleAdapterError,
    LoraNotEnabledError,
    RankTooLargeError,
)

if TYPE_CHECKING:
    import os

    import httpx
    import torch

    from lorasync._adapter import Adapter

__all__ = ["GenerateResult", "SGLangEngine", "pad_ranks", "served_leaves"]

DEFAULT_VERSION = "0.5.23"
_TENSOR_ROUTE_SINCE = (0, 5, 10)
_PER_RANK_FIELD_SINCE = (0, 5, 17)
_SESSION_SINCE = (0, 5, 23)
_MODELS_LIST_ADAPTERS_SINCE = (0, 5, 10)

# SGLang's target-module normalization (sglang/srt/lora/utils.py get_normalized_target_modules):
# a served packed module covers all of its leaves.
_PACKS: dict[str, frozenset[str]] = {
    "qkv_proj": frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj"}),
    "gate_up_proj": frozenset({"gate_proj", "up_proj", "gate_up_proj"}),
    "embed_tokens": frozenset({"embed_tokens", "vocab_emb", "embeddings", "word_embeddings"}),
    "lm_head": frozenset({"lm_head", "output", "unembed_tokens"}),
    "fused_qkv_a_proj_with_mqa": frozenset({"q_a_proj", "kv_a_proj_with_mqa", "fused_qkv_a_proj_with_mqa"}),
}
_PACK_OF = {leaf: pack for pack, leaves in _PACKS.items() for leaf in leaves}
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class GenerateResult:
    """What ``/generate`` returned for one prompt (greedy)."""

    output_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] | None  # per output token, when ``return_logprob=True``


def _parse_version(value: str) -> tuple[int, ...]:
    match = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", str(value).strip())
    if not match:
        raise ConfigError(f"SGLang version must look like '0.5.23' (or 'auto'), got {value!r}")
    return tuple(int(part or 0) for part in match.groups())


def served_leaves(target_modules: Any) -> frozenset[str] | None:
    """Leaf module names an SGLang server started with ``--lora-target-modules`` accepts.

    ``None`` when it accepts anything (``all``, or no list reported).
    """
    if not target_modules:
        return None
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    if any(str(t) in ("all", "all-linear") for t in target_modules):
        return None
    leaves: set[str] = set()
    for module in target_modules:
        leaf = str(module).rsplit(".", 1)[-1]
        pack = _PACK_OF.get(leaf)
        leaves |= _PACKS[pack] if pack else {leaf}
    return frozenset(leaves)


def pad_ranks(adapter: Adapter) -> Adapter:
    """An equivalent adapter whose every module has rank ``max(r_m)`` (zero rows/columns added).

    SGLang ignores ``rank_pattern`` and sizes every module at the config's ``r``; padding A with
    zero rows and B with zero columns leaves ``B·A`` unchanged, and the config is rewritten so
    ``lora_alpha / r`` keeps the adapter's global scale. Only exact for adapters with
    ``engine_safe_scaling`` (run :func:`lorasync.exporters.normalize_scaling` first).

    Args:
        adapter (`Adapter`): the adapter to pad.

    Returns:
        `Adapter`: ``adapter`` itself when its ranks are already uniform, else a padded copy.
    """
    import torch

    from lorasync._adapter import Adapter as _Adapter
    from lorasync._config import AdapterConfig
    from lorasync._keys import peft_key

    ranks = {m: adapter.pair(m)[0].shape[0] for m in adapter.modules}
    r = max(ranks.values())
    config = adapter.config
    if all(rank == config.r for rank in ranks.values()) and not config.rank_pattern:
        return adapter
    tensors: dict[str, torch.Tensor] = {}
    for module in adapter.modules:
        a, b = adapter.pair(module)
        extra = r - a.shape[0]
        if extra:
            a = torch.cat([a, a.new_zeros(extra, a.shape[1])], dim=0)
            b = torch.cat([b, b.new_zeros(b.shape[0], extra)], dim=1)
        tensors[peft_key(module, "A")] = a
        tensors[peft_key(module, "B")] = b
    new_config = AdapterConfig(
        r=r,
        lora_alpha=config.global_scale * r,
        target_modules=config.target_modules,
        base_model_name_or_path=config.base_model_name_or_path,
    )
    return _Adapter(tensors, new_config)


class SGLangEngine(HTTPEngine):
    """Client of one SGLang server (``python -m sglang.launch_server``).

    The server must run with ``--enable-lora --max-lora-rank R --lora-target-modules ...``,
    ``--tokenizer-worker-num 1`` and ``--dp-size 1`` for runtime LoRA updates.

    Args:
        url (`str`): base URL, e.g. ``http://127.0.0.1:30000``.
        version (`str`, *optional*, defaults to ``"0.5.23"``): the server's SGLang version,
            which picks request field names and the weight-update protocol; ``"auto"`` reads it
            from ``/server_info`` once.
        tp_size (`int`, *optional*): TP ranks to send tensor payloads for; read from
            ``/server_info`` when not given.
        weight_bucket_bytes (`int`, *optional*, defaults to 256 MiB): the merged fallback sends
            base weights in requests of at most this many tensor bytes (a larger tensor goes alone).
        checksums (`bool`, *optional*, defaults to `True`): send per-tensor SHA-256 with tensor
            loads (0.5.17+), so SGLang refuses bytes corrupted on the way.
        api_key (`str`, *optional*): ``--api-key``/``--admin-api-key``; defaults to env ``SGLANG_API_KEY``.
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
        timeout: float = 60.0,
        retries: RetryPolicy | int | None = None,
        transport: httpx.BaseTransport | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(
            url, api_key=api_key, timeout=timeout, retries=retries, transport=transport, async_transport=async_transport
        )
        self._version: tuple[int, ...] | None = None if version == "auto" else _parse_version(version)
        if tp_size is not None and tp_size < 1:
            raise ConfigError(f"tp_size must be >= 1, got {tp_size}")
        if weight_bucket_bytes < 1:
            raise ConfigError(f"weight_bucket_bytes must be >= 1, got {weight_bucket_bytes}")
        self._tp_size = tp_size
        self._session_open = False  # a weight-update session opened by begin_weight_update
        self.weight_bucket_bytes = weight_bucket_bytes
        self.checksums = checksums
        self._known: dict[str, str] = {}  # loaded_adapters of the last LoRA answer (pre-0.5.10 listing)

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

    def load_adapter(self, name: str, path: str | os.PathLike[str], *, pinned: bool = False) -> None:
        """Load the PEFT adapter directory ``path`` (as the server sees it) under ``name``.

        Raises:
            AdapterAlreadyLoadedError, AdapterNotFoundError, RankTooLargeError,
            IncompatibleAdapterError, CapacityError, LoraNotEnabledError, AdapterRejectedError.
        """
        self._run(self._load_op(name, str(path), pinned), adapter=name)

    def load_adapter_tensors(self, name: str, adapter: Adapter, *, pinned: bool = False) -> None:
        """Load ``adapter`` under ``name`` with no files (``/load_lora_adapter_from_tensors``).

        Runs :meth:`preflight` first; ranks are padded to one ``r`` (exact, see :func:`pad_ranks`).

        Raises:
            CapabilityError (server older than 0.5.10), the errors of :meth:`preflight` and of
            :meth:`load_adapter`.
        """
        self._run(self._load_tensors_op(name, adapter, pinned), adapter=name)

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name``; SGLang waits for its in-flight requests first.

        Raises:
            AdapterNotFoundError: ``name`` is not loaded.
        """
        self._run(self._unload_op(name), adapter=name)

    def list_adapters(self) -> list[str]:
        """Adapter names served now (``/v1/models`` cards with a ``parent``)."""
        return self._run(self._list_op())

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace base weights in place (HF parameter names), in buckets, inside one
        weight-update session on 0.5.23+.

        Raises:
            EngineError: the server refused (message says why); the session is closed.
        """
        self._run(self._update_weights_op(named_tensors))

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
        result = self.generate(list(prompt_ids), lora_name=name, max_new_tokens=max_tokens, return_logprob=True)
        return list(result.output_ids), list(result.logprobs or ())

    # -- async twins ------------------------------------------------------------------------

    async def agreedy(self, name: str | None, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        result = await self.agenerate(list(prompt_ids), lora_name=name, max_new_tokens=max_tokens, return_logprob=True)
        return list(result.output_ids), list(result.logprobs or ())

    async def acapabilities(self) -> Capabilities:
        return await self._arun(self._capabilities_op())

    async def apreflight(self, adapter: Adapter) -> None:
        await self._arun(self._preflight_op(adapter))

    async def aload_adapter(self, name: str, path: str | os.PathLike[str], *, pinned: bool = False) -> None:
        await self._arun(self._load_op(name, str(path), pinned), adapter=name)

    async def aload_adapter_tensors(self, name: str, adapter: Adapter, *, pinned: bool = False) -> None:
        await self._arun(self._load_tensors_op(name, adapter, pinned), adapter=name)

    async def aunload_adapter(self, name: str) -> None:
        await self._arun(self._unload_op(name), adapter=name)

    async def alist_adapters(self) -> list[str]:
        return await self._arun(self._list_op())

    async def aupdate_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        await self._arun(self._update_weights_op(named_tensors))

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

    # -- operations (sans-IO) ---------------------------------------------------------------

    def _server_info_op(self) -> Operation[dict[str, Any]]:
        response = yield Call("GET", "/server_info")
        if response.status_code == 404:  # servers before /server_info existed
            response = yield Call("GET", "/get_server_info")
        data = body_json(response)
        if response.status_code != 200 or not isinstance(data, dict):
            raise EngineProtocolError(
                f"sglang at {self.url} answered /server_info with HTTP {response.status_code}: "
                f"{body_text(response)[:200]!r}; is this an SGLang server?",
                **self.error_context("/server_info", None, response),
            )
        self._version_notes = check_engine_version("sglang", data.get("version"), url=self.url)  # refuses unknown majors
        if self._version is None:
            self._version = _parse_version(str(data.get("version") or DEFAULT_VERSION))
        return data

    def _capabilities_op(self) -> Operation[Capabilities]:
        info = yield from self._server_info_op()
        return self._capabilities_from(info)

    def _capabilities_from(self, info: Mapping[str, Any]) -> Capabilities:
        version = self._version_or_default()
        lora = bool(info.get("enable_lora"))
        dp = int(info.get("dp_size") or 1)
        workers = int(info.get("tokenizer_worker_num") or 1)
        notes = [f"sglang {'.'.join(map(str, version))}", *getattr(self, "_version_notes", [])]
        if info.get("max_loras_per_batch") is not None:
            notes.append(f"max_loras_per_batch={info['max_loras_per_batch']} (GPU slots, base model included)")
        if lora and info.get("max_lora_rank") is None:
            notes.append("max_lora_rank not reported (inferred from --lora-paths by the server)")
        if dp != 1:
            notes.append(f"dp_size={dp}: SGLang refuses dynamic LoRA unless dp_size == 1")
        if workers != 1:
            notes.append(f"tokenizer_worker_num={workers}: a load is visible to one worker only")
        host = urlsplit(self.url).hostname or ""
        return Capabilities(
            engine=self.kind,
            url=self.url,
            lora=lora,
            runtime_lora=lora and dp == 1 and workers == 1,
            max_rank=info.get("max_lora_rank"),
            max_loras=info.get("max_loaded_loras"),
            target_modules=served_leaves(info.get("lora_target_modules")),
            tensor_load=lora and version >= _TENSOR_ROUTE_SINCE,
            weight_update=True,
            load_inplace=False,
            same_host=host in ("127.0.0.1", "localhost", "::1"),
            notes=tuple(notes),
        )

    def _preflight_op(self, adapter: Adapter, *, pads: bool = False) -> Operation[dict[str, Any]]:
        info = yield from self._server_info_op()
        caps = self._capabilities_from(info)
        caps.check(adapter)
        if not caps.runtime_lora:
            reasons = "; ".join(n for n in caps.notes if n.startswith(("dp_size", "tokenizer_worker_num")))
            raise CapabilityError(
                f"sglang at {self.url} cannot load adapters at runtime ({reasons}); "
                "restart it with --dp-size 1 --tokenizer-worker-num 1",
                engine=self.kind,
                url=self.url,
            )
        _check_sglang_shape(adapter, self.url, pads=pads)
        return info

    def _load_op(self, name: str, path: str, pinned: bool) -> Operation[None]:
        self.refuse_extra_weights(name, path, "/load_lora_adapter")  # SGLang loads every *.safetensors
        body: dict[str, Any] = {"lora_name": name, "lora_path": path}
        if pinned:
            body["pinned"] = True
        response = yield Call("POST", "/load_lora_adapter", json=body)
        try:
            yield from self._lora_result(response, "/load_lora_adapter", name)
        except (AdapterAlreadyLoadedError, EngineProtocolError):
            # A retried load answered "already loaded" (an earlier attempt landed before its
            # answer was lost), or a 200 that is not SGLang's envelope: success only if the
            # engine now serves ``name`` from ``path``.
            retried = response.extensions.get("lorasync_attempts", 1) > 1
            if response.status_code != 200 and not retried:
                raise
            if not (yield from self._serves(name, path)):
                raise

    def _serves(self, name: str, path: str) -> Operation[bool]:
        """True when ``/v1/models`` lists ``name`` loaded from ``path`` (False before 0.5.10)."""
        if self._version_or_default() < _MODELS_LIST_ADAPTERS_SINCE:
            return False
        response = yield Call("GET", "/v1/models")
        data = body_json(response)
        cards = data.get("data") if isinstance(data, dict) and response.status_code == 200 else None
        return any(
            isinstance(card, dict) and card.get("id") == name and card.get("parent") and card.get("root") in (None, path)
            for card in cards or []
        )

    def _load_tensors_op(self, name: str, adapter: Adapter, pinned: bool) -> Operation[None]:
        info = yield from self._preflight_op(adapter, pads=True)
        caps = self._capabilities_from(info)
        version = self._version_or_default()
        if version < _TENSOR_ROUTE_SINCE or not caps.tensor_load:
            raise CapabilityError(
                f"sglang {'.'.join(map(str, version))} at {self.url} has no /load_lora_adapter_from_tensors "
                "(added in 0.5.10); publish through the disk transport instead",
                engine=self.kind,
                url=self.url,
                adapter=name,
            )
        adapter = pad_ranks(adapter)
        tensors = {k: _cpu_copy(t) for k, t in adapter.tensors.items()}
        payload = _serialize(tensors)
        body: dict[str, Any] = {"lora_name": name, "config_dict": _config_dict(adapter)}
        if version >= _PER_RANK_FIELD_SINCE:
            # Rank i reads element i; the payload is self-contained, so every rank gets a copy.
            body["serialized_named_tensors"] = [payload] * (self._tp_size or int(info.get("tp_size") or 1))
            if self.checksums:
                body["expected_checksums"] = {k: _sha256(t) for k, t in tensors.items()}
        else:
            body["serialized_tensors"] = payload
        if pinned:
            body["pinned"] = True
        response = yield Call("POST", "/load_lora_adapter_from_tensors", json=body)
        yield from self._lora_result(response, "/load_lora_adapter_from_tensors", name)

    def _unload_op(self, name: str) -> Operation[None]:
        response = yield Call("POST", "/unload_lora_adapter", json={"lora_name": name})
        try:
            yield from self._lora_result(response, "/unload_lora_adapter", name)
        except EngineProtocolError:
            # A 200 that is not SGLang's envelope: done only if the name is no longer listed.
            if response.status_code != 200 or self._version_or_default() < _MODELS_LIST_ADAPTERS_SINCE:
                raise
            listed = yield Call("GET", "/v1/models")
            data = body_json(listed)
            cards = data.get("data") if isinstance(data, dict) and listed.status_code == 200 else None
            if not isinstance(cards, list) or any(isinstance(c, dict) and c.get("id") == name for c in cards):
                raise

    def _list_op(self) -> Operation[list[str]]:
        if self._version is not None and self._version < _MODELS_LIST_ADAPTERS_SINCE:
            return sorted(self._known)  # /v1/models lists no adapters before 0.5.10
        response = yield Call("GET", "/v1/models")
        data = body_json(response)
        cards = data.get("data") if isinstance(data, dict) else None
        if response.status_code != 200 or not isinstance(cards, list):
            raise EngineProtocolError(
                f"sglang at {self.url} answered /v1/models with HTTP {response.status_code}: "
                f"{body_text(response)[:200]!r}",
                **self.error_context("/v1/models", None, response),
            )
        return sorted(str(card["id"]) for card in cards if isinstance(card, dict) and card.get("parent"))

    def _update_weights_op(self, named_tensors: Mapping[str, torch.Tensor]) -> Operation[None]:
        tp = self._tp_size
        if tp is None or self._version is None:
            info = yield from self._server_info_op()
            tp = tp or int(info.get("tp_size") or 1)
        version = self._version_or_default()
        buckets = _buckets(named_tensors, self.weight_bucket_bytes)
        # Inside begin/end_weight_update the caller's session brackets every bucket.
        session = version >= _SESSION_SINCE and not self._session_open
        if session:
            response = yield Call("POST", "/begin_weight_update", json={}, retry=False)
            self._weight_result(response, "/begin_weight_update")
        try:
            for i, bucket in enumerate(buckets):
                payload = _serialize([(name, _cpu_copy(t)) for name, t in bucket])
                body = {"serialized_named_tensors": [payload] * tp, "flush_cache": i == len(buckets) - 1}
                response = yield Call("POST", "/update_weights_from_tensor", json=body)
                self._weight_result(response, "/update_weights_from_tensor")
        except Exception:
            if session:
                try:  # close the session, keeping the original error
                    yield Call("POST", "/end_weight_update", json={}, retry=False)
                except EngineError:
                    pass
            raise
        if session:
            response = yield Call("POST", "/end_weight_update", json={}, retry=False)
            self._weight_result(response, "/end_weight_update")

    def _session_op(self, begin: bool) -> Operation[None]:
        if self._version is None:
            yield from self._server_info_op()
        if self._version_or_default() < _SESSION_SINCE:
            return  # older servers have no sessions
        if begin == self._session_open:
            return
        route = "/begin_weight_update" if begin else "/end_weight_update"
        response = yield Call("POST", route, json={}, retry=False)
        self._session_open = begin
        self._weight_result(response, route)

    def _update_from_disk_op(self, path: str, weight_version: str | None) -> Operation[None]:
        body: dict[str, Any] = {"model_path": path}
        if weight_version is not None:
            body["weight_version"] = weight_version
        response = yield Call("POST", "/update_weights_from_disk", json=body)
        self._weight_result(response, "/update_weights_from_disk")

    def _generate_op(
        self, input_ids: list[int], lora_name: str | None, max_new_tokens: int, return_logprob: bool
    ) -> Operation[GenerateResult]:
        body: dict[str, Any] = {
            "input_ids": [int(i) for i in input_ids],
            "sampling_params": {"max_new_tokens": int(max_new_tokens), "temperature": 0.0},
        }
        if lora_name is not None:
            body["lora_path"] = lora_name  # the adapter *name*, despite the field's name
        if return_logprob:
            body["return_logprob"] = True
        response = yield Call("POST", "/generate", json=body)
        data = body_json(response)
        if response.status_code != 200:
            error = data.get("error") if isinstance(data, dict) else None
            message = str(error.get("message")) if isinstance(error, dict) else body_text(response)[:300]
            raise self._generate_error(message, response, lora_name)
        if not isinstance(data, dict) or "output_ids" not in data:
            raise EngineProtocolError(
                f"sglang at {self.url} answered /generate with {body_text(response)[:200]!r}",
                **self.error_context("/generate", lora_name, response),
            )
        logprobs = None
        if return_logprob:
            entries = (data.get("meta_info") or {}).get("output_token_logprobs") or []
            logprobs = tuple(float(entry[0]) for entry in entries)
        return GenerateResult(tuple(int(t) for t in data["output_ids"]), str(data.get("text", "")), logprobs)

    # -- answers ----------------------------------------------------------------------------

    def _lora_result(self, response: httpx.Response, path: str, name: str) -> Operation[None]:
        data = body_json(response)
        if isinstance(data, dict) and "success" in data:
            if isinstance(data.get("loaded_adapters"), dict):
                self._known = {str(k): str(v) for k, v in data["loaded_adapters"].items()}
            if data["success"] and response.status_code == 200:
                return
            message = str(data.get("error_message") or "")
            error = self._lora_error(message, response, path, name)
            if isinstance(error, _NeedsRankCheck):
                info = yield from self._server_info_op()
                error = self._rank_or_modules(message, response, path, name, info)
            raise error
        raise self._unexpected(response, path, name)

    def _lora_error(self, message: str, response: httpx.Response, path: str, name: str) -> EngineError:
        context = self.error_context(path, name, response)
        where = f"sglang at {self.url}"
        if "LoRA is not enabled" in message:
            return LoraNotEnabledError(
                f"{where} was started without LoRA: {message} (also pass --max-lora-rank and --lora-target-modules)",
                **context,
            )
        if "already loaded" in message:
            return AdapterAlreadyLoadedError(
                f"{where} already serves an adapter named {name!r}; SGLang has no in-place reload, so "
                f"unload it first or load under a new versioned name ({message})",
                **context,
            )
        if "does not exist" in message and "Loaded LoRAs" in message:
            return AdapterNotFoundError(f"{where} serves no adapter named {name!r}: {message}", **context)
        if "is incompatible with the current LoRA memory pool" in message:
            return _NeedsRankCheck(message)
        if "doesn't support DoRA" in message or "add tokens to the vocabulary" in message or "target module" in message:
            return IncompatibleAdapterError(f"{where} cannot serve adapter {name!r}: {message}", **context)
        if "as a pinned adapter" in message:
            return CapacityError(
                f"{where} has no slot left to pin adapter {name!r}: {message}", **context
            )
        if "incomplete unload" in message:
            return EngineError(f"{where}: {message} (call unload_adapter({name!r}) again)", **context)
        if "[LORA-CHECK]" in message:
            return AdapterRejectedError(
                f"{where} received adapter {name!r} corrupted (checksums differ): {message}; retry the load",
                **context,
            )
        if any(
            text in message
            for text in ("No such file or directory", "Repo id must be", "Cannot find any model weights", "is not a local folder")
        ):
            return AdapterNotFoundError(
                f"{where} found no PEFT adapter for {name!r} at the path it was given: {message}; the path "
                "must exist on the server's host and hold adapter_config.json and *.safetensors",
                **context,
            )
        return AdapterRejectedError(f"{where} refused adapter {name!r}: {message}", **context)

    def _rank_or_modules(
        self, message: str, response: httpx.Response, path: str, name: str, info: Mapping[str, Any]
    ) -> EngineError:
        context = self.error_context(path, name, response)
        match = re.search(r"with rank (\d+)", message)
        rank = int(match.group(1)) if match else None
        max_rank = info.get("max_lora_rank")
        if rank is not None and isinstance(max_rank, int) and rank > max_rank:
            return RankTooLargeError(
                f"adapter {name!r} has rank {rank} but sglang at {self.url} was started with "
                f"--max-lora-rank {max_rank}; restart it with a larger --max-lora-rank or train r <= {max_rank}",
                rank=rank,
                max_rank=max_rank,
                **context,
            )
        return IncompatibleAdapterError(
            f"adapter {name!r} targets modules sglang at {self.url} was not started for "
            f"(--lora-target-modules {info.get('lora_target_modules')}); restart it with those modules: {message}",
            **context,
        )

    def _weight_result(self, response: httpx.Response, path: str) -> None:
        data = body_json(response)
        if isinstance(data, dict) and "success" in data:
            if data["success"] and response.status_code == 200:
                return
            message = str(data.get("message") or "")
            hint = ""
            if "must run between" in message:
                hint = " (the server is 0.5.23 or newer: use version='0.5.23' or 'auto')"
            elif "session is already open" in message:
                hint = " (another client is updating weights, or a previous update died; retry later)"
            raise EngineError(
                f"sglang at {self.url}{path} refused the weight update: {message}{hint}",
                **self.error_context(path, None, response),
            )
        raise self._unexpected(response, path, None)

    def _generate_error(self, message: str, response: httpx.Response, lora_name: str | None) -> EngineError:
        context = self.error_context("/generate", lora_name, response)
        if "never been loaded" in message:
            return AdapterNotFoundError(
                f"sglang at {self.url} serves no adapter named {lora_name!r}: {message}", **context
            )
        if "LoRA is not enabled" in message:
            return LoraNotEnabledError(f"sglang at {self.url} was started without LoRA: {message}", **context)
        return EngineError(f"sglang at {self.url} refused /generate: {message}", **context)

    def _unexpected(self, response: httpx.Response, path: str, name: str | None) -> EngineError:
        context = self.error_context(path, name, response)
        status = response.status_code
        text = body_text(response)[:300]
        if status == 404:
            return CapabilityError(
                f"sglang at {self.url} has no route {path} (HTTP 404); the server is older than this "
                f"client assumes (version={'.'.join(map(str, self._version_or_default()))}) or not SGLang",
                **context,
            )
        if status >= 500:
            return EngineError(
                f"sglang at {self.url}{path} failed with HTTP {status}: {text!r}; SGLang asserts "
                "dp_size == 1 for LoRA updates (start with --dp-size 1), otherwise check its log",
                **context,
            )
        return EngineProtocolError(
            f"sglang at {self.url}{path} answered HTTP {status} with {text!r}, which this client "
            "cannot interpret; check version= against the server's version",
            **context,
        )

    def _version_or_default(self) -> tuple[int, ...]:
        return self._version if self._version is not None else _parse_version(DEFAULT_VERSION)


class _NeedsRankCheck(EngineError):
    """Internal: the "incompatible" text covers rank and modules; server_info decides which."""


def _check_sglang_shape(adapter: Adapter, url: str, *, pads: bool) -> None:
    """SGLang-specific refusals that its own load would not raise, or raise cryptically.

    ``pads``: the caller pads mixed ranks (tensor loads), so they are not refused.
    """
    if not adapter.engine_safe_scaling:
        raise IncompatibleAdapterError(
            "SGLang scales every module by lora_alpha / r and ignores use_rslora, rank_pattern and "
            "alpha_pattern, so this adapter would be served with the wrong scale; convert it with "
            "lorasync.exporters.normalize_scaling(adapter) first",
            engine="sglang",
            url=url,
        )
    ranks = {adapter.pair(m)[0].shape[0] for m in adapter.modules}
    if not pads and ranks != {adapter.config.r}:
        raise IncompatibleAdapterError(
            f"adapter has per-module ranks {sorted(ranks)} but SGLang ignores rank_pattern and sizes "
            f"every module at r={adapter.config.r} (it fails at the first batch); write "
            "lorasync.engines.sglang.pad_ranks(adapter) instead, which is exact",
            engine="sglang",
            url=url,
        )
    layers: dict[tuple[str, str], set[str]] = {}
    for module in adapter.modules:
        prefix, _, leaf = module.rpartition(".")
        layers.setdefault((prefix, _PACK_OF.get(leaf, leaf)), set()).add(leaf)
    for (prefix, pack), leaves in sorted(layers.items()):
        need: set[str] = set()
        if pack == "qkv_proj" and leaves & {"q_proj", "k_proj", "v_proj"}:
            need = {"q_proj", "v_proj"}
        elif pack == "gate_up_proj" and "up_proj" in leaves:
            need = {"gate_proj"}
        missing = sorted(need - leaves)
        if missing:
            raise IncompatibleAdapterError(
                f"{prefix}: SGLang packs {pack} and needs LoRA on {missing} wherever {sorted(leaves)} "
                "is adapted (otherwise its load fails or the module is silently dropped); train those "
                "modules too, or add them with zero lora_B",
                engine="sglang",
                url=url,
                modules=missing,
            )


def _config_dict(adapter: Adapter) -> dict[str, Any]:
    """The ``adapter_config.json`` content SGLang's ``LoRAConfig.from_dict`` reads."""
    config = adapter.config
    leaves = sorted({m.rsplit(".", 1)[-1] for m in adapter.modules})
    return {
        "peft_type": "LORA",
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "target_modules": leaves,
        "base_model_name_or_path": config.base_model_name_or_path,
        "use_dora": False,
        "bias": "none",
    }


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    # clone(): a pickled view would carry its whole storage.
    return tensor.detach().to("cpu").contiguous().clone()


def _serialize(obj: Any) -> str:
    """``base64(pickle)`` as SGLang's ``MultiprocessingSerializer.deserialize`` reads it.

    A plain pickle (not ``ForkingPickler``) stores each tensor's bytes inline, through
    ``torch.storage._load_from_bytes``, which SGLang's allowlisting unpickler maps to
    ``torch.load(weights_only=True)``: no shared-memory handles, so it works across hosts.
    """
    buffer = io.BytesIO()
    pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _sha256(tensor: torch.Tensor) -> str:
    # SGLang's check: sha256 of the contiguous flattened bytes (tp_worker.py).
    import torch

    return hashlib.sha256(tensor.contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


def _buckets(named_tensors: Mapping[str, torch.Tensor], limit: int) -> list[list[tuple[str, torch.Tensor]]]:
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > limit:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
