"""Loads from tensors, in both protocols SGLang has had: the operations behind ``load_adapter_tensors``.

* ``tensors`` (0.5.10 ... 0.5.23): one ``POST /load_lora_adapter_from_tensors`` carrying the PEFT
  config and ``base64(pickle)`` of the tensors (per TP rank from 0.5.17; with sha256 checksums
  per tensor from 0.5.16).
* ``streamed`` (SGLang main, PR #36384, which removed the route above): ``POST
  /register_lora_adapter {lora_name, config_dict}`` creates the name with zero weights, then the
  tensors, named ``"{lora_name}:{PEFT key}"``, go through ``/update_weights_from_tensor`` inside
  one ``/begin_weight_update`` ... ``/end_weight_update`` session; SGLang stashes them per session
  and applies them at ``end_weight_update``. One session per load, always closed.

:meth:`~.operations.SGLangOperations._protocol_op` picks the protocol from the server's routes.
A load is a transaction (design invariant 13): a streamed load that fails after the name may
have been registered (a step refused, or its answer lost: then the unload reads the state back)
unregisters it before the session closes, so neither zero weights nor a part of the stream ever
serve under the name; a legacy load whose answer was lost is unloaded the same way. Only
SGLang's own refusal of the first step proves nothing landed. If even the unload fails, the error
says so and names the adapter to unload. An async load whose caller is cancelled stops at its
next step and undoes what landed (a request already on its way is answered first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lorasync.engines._http import Call, Operation, body_json
from lorasync.engines.sglang import errors
from lorasync.engines.sglang.operations import SGLangOperations
from lorasync.engines.sglang.protocol import (
    CHECKSUMS_SINCE,
    PER_RANK_FIELD_SINCE,
    REGISTER_ROUTE,
    STREAMED,
    TENSOR_ROUTE,
    buckets,
    config_dict,
    cpu_copy,
    serialize,
    sha256,
    streamed_tensors,
)
from lorasync.errors import (
    AdapterAlreadyLoadedError,
    AdapterNotFoundError,
    CapabilityError,
    EngineError,
)
from lorasync.transforms import pad_ranks

if TYPE_CHECKING:
    import httpx
    import torch

    from lorasync.adapter._adapter import Adapter

__all__ = ["TensorLoads"]


class TensorLoads(SGLangOperations):
    """The tensor-load operations of :class:`~lorasync.engines.sglang.client.SGLangEngine`."""

    # Streamed loads in progress: registered name -> whether its session is open (read by the
    # client to clean up after a cancellation, which no operation sees). Set in __init__.
    _streaming: dict[str, bool]
    _cancelled: set[str]  # async loads whose caller was cancelled (set by the client)

    def _load_tensors_op(self, name: str, adapter: Adapter, pinned: bool) -> Operation[None]:
        info = yield from self._preflight_op(adapter, pads=True)
        caps = self._capabilities_from(info)
        protocol = yield from self._protocol_op()
        version = self._version_or_default()
        if protocol is None or not caps.tensor_load:
            raise CapabilityError(
                f"sglang {'.'.join(map(str, version))} at {self.url} offers no route to load adapters from "
                f"tensors (neither {TENSOR_ROUTE}, 0.5.10-0.5.23, nor {REGISTER_ROUTE}, SGLang main); "
                "publish through the disk transport instead",
                engine=self.kind,
                url=self.url,
                adapter=name,
            )
        adapter = pad_ranks(adapter)
        tensors = {k: cpu_copy(t) for k, t in adapter.tensors.items()}
        tp = self._tp_size or int(info.get("tp_size") or 1)
        if protocol == STREAMED:
            yield from self._stream_op(name, adapter, tensors, tp, pinned)
            return
        payload = serialize(tensors)
        body: dict[str, Any] = {"lora_name": name, "config_dict": config_dict(adapter)}
        if version >= PER_RANK_FIELD_SINCE:
            # Rank i reads element i; the payload is self-contained, so every rank gets a copy.
            body["serialized_named_tensors"] = [payload] * tp
        else:
            body["serialized_tensors"] = payload
        if self.checksums and version >= CHECKSUMS_SINCE:
            # Of the very copies serialized above: SGLang refuses bytes that differ on arrival
            # (0.5.16-0.5.23: its scheduler raises and the server dies; nothing torn is served).
            body["expected_checksums"] = {k: sha256(t) for k, t in tensors.items()}
        if pinned:
            body["pinned"] = True
        refused = False
        try:
            response = yield Call("POST", TENSOR_ROUTE, json=body)
            # SGLang's refusal proves nothing landed, unless a retry is refused because the name is
            # there: an earlier attempt landed and its answer was lost.
            refused = _refusal(response) and response.extensions.get("lorasync_attempts", 1) == 1
            self._route_gone(response)
            yield from self._lora_result(response, TENSOR_ROUTE, name)
            self._stop_if_cancelled(name)
        except EngineError as exc:
            if not refused:  # the load may have landed whole: take it out again (read back by the unload)
                yield from self._stream_abort_op(name, exc)
            raise

    def _stream_op(self, name: str, adapter: Adapter, tensors: dict[str, torch.Tensor], tp: int, pinned: bool) -> Operation[None]:
        named = streamed_tensors(name, tensors)  # refuses a name SGLang could not split, before anything moves
        if self._session_open:
            raise EngineError(
                f"sglang at {self.url}: a weight-update session opened by begin_weight_update() is still open; "
                f"close it (end_weight_update) before streaming adapter {name!r}, whose load needs a session of its own",
                engine=self.kind,
                url=self.url,
                adapter=name,
            )
        # Registering an existing name re-zeroes it (SGLang's create-or-refresh): refuse as the
        # legacy route does, before a serving adapter loses its weights.
        if name in (yield from self._list_op()):
            raise AdapterAlreadyLoadedError(
                f"sglang at {self.url} already serves an adapter named {name!r}; registering it again would zero "
                "its weights while it serves, so unload it first or load under a new versioned name",
                engine=self.kind,
                url=self.url,
                adapter=name,
            )
        body: dict[str, Any] = {"lora_name": name, "config_dict": config_dict(adapter)}
        if pinned:
            body["pinned"] = True
        # A transaction from the registration on (invariant 13): every step that may have landed
        # is undone when a later one fails or its answer is lost. Only SGLang's own refusal of a
        # step proves it did not land; anything else (no answer, a proxy's 5xx, a body that is not
        # SGLang's) is settled by the undo, which reads the name back (unload: gone, or not there).
        self._streaming[name] = False  # from here the name may be registered with zero weights
        refused = False
        try:
            response = yield Call("POST", REGISTER_ROUTE, json=body)
            refused = _refusal(response)
            self._route_gone(response)
            yield from self._lora_result(response, REGISTER_ROUTE, name)
            self._stop_if_cancelled(name)
            # A begin whose answer is lost may have opened the session: close it in the undo too.
            self._streaming[name] = True
            refused = False
            response = yield Call("POST", "/begin_weight_update", json={}, retry=False)
            if _refusal(response):
                self._streaming[name] = False  # refused (another session is open): none of ours to close
            self._stream_result(response, "/begin_weight_update", name)
            self._stop_if_cancelled(name)
            for bucket in buckets(named, self.weight_bucket_bytes):
                # flush_cache False: no base weight changes, and SGLang keys its radix cache by adapter id.
                body = {"serialized_named_tensors": [serialize(bucket)] * tp, "flush_cache": False}
                response = yield Call("POST", "/update_weights_from_tensor", json=body)
                self._stream_result(response, "/update_weights_from_tensor", name)
                self._stop_if_cancelled(name)
            response = yield Call("POST", "/end_weight_update", json={}, retry=False)
            self._streaming[name] = False  # answered: SGLang closed the session, applied or not
            self._stream_result(response, "/end_weight_update", name)
            if not (yield from self._serves(name, None)):
                raise EngineError(
                    f"sglang at {self.url} does not list {name!r} after applying its streamed tensors "
                    "(it restarted or dropped the adapter); publish again",
                    engine=self.kind,
                    url=self.url,
                    adapter=name,
                )
        except EngineError as exc:
            if refused:  # SGLang refused the registration itself: nothing to undo
                self._streaming.pop(name, None)
                raise
            yield from self._stream_abort_op(name, exc)
            raise
        # Not in a finally: a cancelled load leaves its entry for the client's clean-up.
        self._streaming.pop(name, None)

    def _stream_abort_op(self, name: str, error: EngineError | None) -> Operation[None]:
        """Take a registered name whose stream did not complete out of service, then close the
        session if it is open. The unload goes first: the session's stash is applied when it
        closes, and must then belong to no served name."""
        session = self._streaming.pop(name, False)
        try:
            response = yield Call("POST", "/unload_lora_adapter", json={"lora_name": name})
            yield from self._lora_result(response, "/unload_lora_adapter", name)
        except AdapterNotFoundError:
            pass  # not registered (any more): the goal holds
        except EngineError as unload_error:
            if error is not None:
                error.message += (
                    f"; lorasync could not unregister {name!r} afterwards ({unload_error.message}), so SGLang may "
                    f"serve it with zero or partial weights: unload_adapter({name!r}) before anything requests it"
                )
                error.args = (error.message,)
        if session:
            try:
                yield Call("POST", "/end_weight_update", json={}, retry=False)
            except EngineError:
                pass  # keep the stream's own error

    def _stop_if_cancelled(self, name: str) -> None:
        """End the load of ``name`` here (its undo follows) when its async caller was cancelled."""
        if name in self._cancelled:
            raise EngineError(
                f"the load of {name!r} into sglang at {self.url} was cancelled; what had landed was taken out again",
                engine=self.kind,
                url=self.url,
                adapter=name,
            )

    def _stream_result(self, response: httpx.Response, path: str, name: str) -> None:
        self._route_gone(response)
        data = body_json(response)
        if isinstance(data, dict) and "success" in data and not (data["success"] and response.status_code == 200):
            context = self.error_context(path, name, response)
            raise errors.stream_error(str(data.get("message") or ""), url=self.url, path=path, name=name, context=context)
        self._weight_result(response, path)

    def _route_gone(self, response: httpx.Response) -> None:
        if response.status_code == 404:
            self._forget_protocol()  # the next load reads the routes again


def _refusal(response: httpx.Response) -> bool:
    """SGLang's own answer that it did not do the step (its envelope with ``success`` false):
    the one answer that proves nothing landed."""
    data = body_json(response)
    return isinstance(data, dict) and data.get("success") is False
