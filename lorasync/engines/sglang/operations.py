"""The SGLang client's operations, each written once as a sans-IO generator.

:class:`SGLangOperations` yields :class:`~lorasync.engines._http.Call` objects and reads the
answers; :class:`~lorasync.engines.sglang.client.SGLangEngine` drives every operation with the
sync (``_run``) or the async (``_arun``) HTTP client, so the public methods and their
``a``-prefixed twins are one line each. Tests step these generators with recorded answers of
server versions no peer runs.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lorasync.engines._engine import Capabilities
from lorasync.engines._versions import check_engine_version
from lorasync.engines._http import Call, HTTPEngine, Operation, body_json, body_text
from lorasync.engines.sglang import errors, rules
from lorasync.engines.sglang.protocol import (
    DEFAULT_VERSION,
    MODELS_LIST_ADAPTERS_SINCE,
    REGISTER_ROUTE,
    SESSION_SINCE,
    STREAMED,
    TENSOR_ROUTE,
    TENSOR_ROUTE_SINCE,
    TENSORS,
    GenerateResult,
    buckets,
    cpu_copy,
    generate_body,
    parse_version,
    protocol_from_routes,
    serialize,
)
from lorasync.errors import AdapterAlreadyLoadedError, CapabilityError, EngineError, EngineProtocolError

if TYPE_CHECKING:
    import httpx
    import torch

    from lorasync.adapter._adapter import Adapter

__all__ = ["SGLangOperations"]

log = logging.getLogger("lorasync.engines.sglang")


class SGLangOperations(HTTPEngine):
    """The sans-IO operations and answer handling of :class:`SGLangEngine` (its base class)."""

    # Set by SGLangEngine.__init__.
    _version: tuple[int, ...] | None
    _tp_size: int | None
    _session_open: bool
    _known: dict[str, str]
    _protocol: str | None  # the tensor protocol (protocol.TENSORS / STREAMED), once _protocol_known
    _protocol_known: bool
    weight_bucket_bytes: int
    checksums: bool
    same_host: bool

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
            self._version = parse_version(str(data.get("version") or DEFAULT_VERSION))
        return data

    def _capabilities_op(self) -> Operation[Capabilities]:
        info = yield from self._server_info_op()
        yield from self._protocol_op()
        return self._capabilities_from(info)

    def _protocol_op(self) -> Operation[str | None]:
        """Which way the server takes tensors (None: no way), decided by the routes it offers.

        Servers older than 0.5.23 follow the version table (0.5.10 brought the tensor route).
        From 0.5.23 on the version says too little (SGLang main builds report a 0.5.x version
        and may lack the tensor route), so the routes decide: ``/openapi.json``'s paths, or,
        where the docs are off (``DISABLE_OPENAPI_DOC``), a GET on each POST route, which
        answers 405 where the route exists and 404 where it does not. Read once per client.
        """
        if self._protocol_known:
            return self._protocol
        version = self._version_or_default()
        protocol: str | None = TENSORS if version >= TENSOR_ROUTE_SINCE else None
        if version >= SESSION_SINCE:
            response = yield Call("GET", "/openapi.json")
            data = body_json(response)
            if response.status_code == 200 and isinstance(data, dict) and isinstance(data.get("paths"), dict):
                protocol = protocol_from_routes(data["paths"])
            else:
                probes: list[int] = []
                for route, kind in ((REGISTER_ROUTE, STREAMED), (TENSOR_ROUTE, TENSORS)):
                    probe = yield Call("GET", route)
                    probes.append(probe.status_code)
                    if probe.status_code == 405:
                        protocol = kind
                        break
                else:
                    # Both 404: neither route. Anything else (a proxy in the way?): the version table's.
                    protocol = TENSORS if any(status != 404 for status in probes) else None
        self._protocol, self._protocol_known = protocol, True
        log.info("sglang at %s takes adapters from tensors through %s", self.url, _PROTOCOL_WORDS[protocol])
        return protocol

    def _forget_protocol(self) -> None:
        """The server answered a tensor route with 404: it changed (restarted as another build)."""
        self._protocol, self._protocol_known = None, False

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
        protocol = self._protocol if self._protocol_known else (TENSORS if version >= TENSOR_ROUTE_SINCE else None)
        if lora:
            notes.append(f"tensor loads: {_PROTOCOL_WORDS[protocol]}")
        return Capabilities(
            engine=self.kind,
            url=self.url,
            lora=lora,
            runtime_lora=lora and dp == 1 and workers == 1,
            max_rank=info.get("max_lora_rank"),
            max_loras=info.get("max_loaded_loras"),
            target_modules=rules.served_leaves(info.get("lora_target_modules")),
            tensor_load=lora and protocol is not None,
            weight_update=True,
            load_inplace=False,
            unload_drains=True,  # SGLang 0.5.23 answers an unload only once its requests finished
            same_host=self.same_host,
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
        rules.check(adapter, url=self.url, pads=pads)
        yield from self._protocol_op()  # after the refusals, which need no more requests
        return info

    def _load_op(self, name: str, path: str, pinned: bool) -> Operation[None]:
        self.refuse_extra_weights(name, path, "/load_lora_adapter")  # SGLang loads every *.safetensors
        self._refuse_mixed_ranks(path)
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

    def _refuse_mixed_ranks(self, path: str) -> None:
        """The disk-route rule, from a local directory's config (remote paths pass)."""
        try:
            with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return  # not visible here, or malformed: SGLang's own loader answers
        if isinstance(config, dict):
            rules.check_saved_config(config, url=self.url, path=path)

    def _serves(self, name: str, path: str | None) -> Operation[bool]:
        """True when ``/v1/models`` lists ``name`` loaded from ``path`` (any path when None;
        False before 0.5.10)."""
        if self._version_or_default() < MODELS_LIST_ADAPTERS_SINCE:
            return False
        response = yield Call("GET", "/v1/models")
        data = body_json(response)
        cards = data.get("data") if isinstance(data, dict) and response.status_code == 200 else None
        return any(
            isinstance(card, dict) and card.get("id") == name and card.get("parent") and (path is None or card.get("root") in (None, path))
            for card in cards or []
        )

    def _unload_op(self, name: str) -> Operation[None]:
        response = yield Call("POST", "/unload_lora_adapter", json={"lora_name": name})
        try:
            yield from self._lora_result(response, "/unload_lora_adapter", name)
        except EngineProtocolError:
            # A 200 that is not SGLang's envelope: done only if the name is no longer listed.
            if response.status_code != 200 or self._version_or_default() < MODELS_LIST_ADAPTERS_SINCE:
                raise
            listed = yield Call("GET", "/v1/models")
            data = body_json(listed)
            cards = data.get("data") if isinstance(data, dict) and listed.status_code == 200 else None
            if not isinstance(cards, list) or any(isinstance(c, dict) and c.get("id") == name for c in cards):
                raise

    def _list_op(self) -> Operation[list[str]]:
        if self._version is not None and self._version < MODELS_LIST_ADAPTERS_SINCE:
            return sorted(self._known)  # /v1/models lists no adapters before 0.5.10
        return sorted((yield from self._cards_op()))

    def _sources_op(self) -> Operation[dict[str, str | None] | None]:
        """Each adapter's ``lora_path`` from ``/v1/models``; tensor loads all show ``__tensor__``,
        which names no one load (None). None before 0.5.10 (no adapter cards)."""
        if self._version is not None and self._version < MODELS_LIST_ADAPTERS_SINCE:
            return None
        cards = yield from self._cards_op()
        return {name: root if isinstance(root, str) and os.path.isabs(root) else None for name, root in cards.items()}

    def _cards_op(self) -> Operation[dict[str, object]]:
        response = yield Call("GET", "/v1/models")
        data = body_json(response)
        cards = data.get("data") if isinstance(data, dict) else None
        if response.status_code != 200 or not isinstance(cards, list):
            raise EngineProtocolError(
                f"sglang at {self.url} answered /v1/models with HTTP {response.status_code}: "
                f"{body_text(response)[:200]!r}",
                **self.error_context("/v1/models", None, response),
            )
        return {str(card["id"]): card.get("root") for card in cards if isinstance(card, dict) and card.get("parent")}

    def _update_weights_op(self, named_tensors: Mapping[str, torch.Tensor]) -> Operation[None]:
        tp = self._tp_size
        if tp is None or self._version is None:
            info = yield from self._server_info_op()
            tp = tp or int(info.get("tp_size") or 1)
        version = self._version_or_default()
        parts = buckets(named_tensors, self.weight_bucket_bytes)
        # Inside begin/end_weight_update the caller's session brackets every bucket.
        session = version >= SESSION_SINCE and not self._session_open
        if session:
            response = yield Call("POST", "/begin_weight_update", json={}, retry=False)
            self._weight_result(response, "/begin_weight_update")
        try:
            for i, bucket in enumerate(parts):
                payload = serialize([(name, cpu_copy(t)) for name, t in bucket])
                body = {"serialized_named_tensors": [payload] * tp, "flush_cache": i == len(parts) - 1}
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
        if self._version_or_default() < SESSION_SINCE:
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
        response = yield Call("POST", "/generate", json=generate_body(input_ids, lora_name, max_new_tokens, return_logprob))
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

    def _greedy_op(self, name: str | None, prompt_ids: list[int], max_tokens: int) -> Operation[tuple[list[int], list[float]]]:
        result = yield from self._generate_op(list(prompt_ids), name, max_tokens, True)
        return list(result.output_ids), list(result.logprobs or ())

    # -- answers ----------------------------------------------------------------------------

    def _lora_result(self, response: httpx.Response, path: str, name: str) -> Operation[None]:
        data = body_json(response)
        if isinstance(data, dict) and "success" in data:
            if isinstance(data.get("loaded_adapters"), dict):
                self._known = {str(k): str(v) for k, v in data["loaded_adapters"].items()}
            if data["success"] and response.status_code == 200:
                return
            message = str(data.get("error_message") or "")
            context = self.error_context(path, name, response)
            error = errors.lora_error(message, url=self.url, name=name, context=context)
            if isinstance(error, errors.NeedsRankCheck):
                info = yield from self._server_info_op()
                error = errors.rank_or_modules(message, url=self.url, name=name, info=info, context=context)
            raise error
        raise self._unexpected(response, path, name)

    def _weight_result(self, response: httpx.Response, path: str) -> None:
        data = body_json(response)
        if isinstance(data, dict) and "success" in data:
            if data["success"] and response.status_code == 200:
                return
            context = self.error_context(path, None, response)
            raise errors.weight_error(str(data.get("message") or ""), url=self.url, path=path, context=context)
        raise self._unexpected(response, path, None)

    def _generate_error(self, message: str, response: httpx.Response, lora_name: str | None) -> EngineError:
        context = self.error_context("/generate", lora_name, response)
        return errors.generate_error(message, url=self.url, lora_name=lora_name, context=context)

    def _unexpected(self, response: httpx.Response, path: str, name: str | None) -> EngineError:
        version = ".".join(map(str, self._version_or_default()))
        context = self.error_context(path, name, response)
        return errors.unexpected(
            response.status_code, body_text(response)[:300], url=self.url, path=path, version=version, context=context
        )

    def _version_or_default(self) -> tuple[int, ...]:
        return self._version if self._version is not None else parse_version(DEFAULT_VERSION)


_PROTOCOL_WORDS = {
    TENSORS: f"{TENSOR_ROUTE} (legacy)",
    STREAMED: f"{REGISTER_ROUTE} + a weight-update stream (SGLang main, PR #36384)",
    None: "no route (publish through the disk transport)",
}
