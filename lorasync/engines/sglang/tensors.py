"""Loads from tensors, in both protocols SGLang has had: the operations behind ``load_adapter_tensors``.

* ``tensors`` (0.5.10 ... 0.5.23): one ``POST /load_lora_adapter_from_tensors`` carrying the PEFT
  config and ``base64(pickle)`` of the tensors (per TP rank from 0.5.17, with checksums).
* ``streamed`` (SGLang main, PR #36384, which removed the route above): ``POST
  /register_lora_adapter {lora_name, config_dict}`` creates the name with zero weights, then the
  tensors, named ``"{lora_name}:{PEFT key}"``, go through ``/update_weights_from_tensor`` inside
  one ``/begin_weight_update`` ... ``/end_weight_update`` session; SGLang stashes them per session
  and applies them at ``end_weight_update``. One session per load, always closed.

:meth:`~.operations.SGLangOperations._protocol_op` picks the protocol from the server's routes.
A streamed load that fails after the name was registered unregisters it before the session
closes, so neither zero weights nor a part of the stream ever serve under the name; if even the
unload fails, the error says so and names the adapter to unload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lorasync.engines._http import Call, Operation, body_json
from lorasync.engines.sglang import errors
from lorasync.engines.sglang.operations import SGLangOperations
from lorasync.engines.sglang.protocol import (
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

    from lorasync._adapter import Adapter

__all__ = ["TensorLoads"]


class TensorLoads(SGLangOperations):
    """The tensor-load operations of :class:`~lorasync.engines.sglang.client.SGLangEngine`."""

    # Streamed loads in progress: registered name -> whether its session is open (read by the
    # client to clean up after a cancellation, which no operation sees). Set in __init__.
    _streaming: dict[str, bool]

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
            if self.checksums:
                body["expected_checksums"] = {k: sha256(t) for k, t in tensors.items()}
        else:
            body["serialized_tensors"] = payload
        if pinned:
            body["pinned"] = True
        response = yield Call("POST", TENSOR_ROUTE, json=body)
        self._route_gone(response)
        yield from self._lora_result(response, TENSOR_ROUTE, name)

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
        response = yield Call("POST", REGISTER_ROUTE, json=body)
        self._route_gone(response)
        yield from self._lora_result(response, REGISTER_ROUTE, name)
        self._streaming[name] = False  # registered with zero weights: it serves trained ones or goes
        try:
            response = yield Call("POST", "/begin_weight_update", json={}, retry=False)
            self._stream_result(response, "/begin_weight_update", name)
            self._streaming[name] = True
            for bucket in buckets(named, self.weight_bucket_bytes):
                # flush_cache False: no base weight changes, and SGLang keys its radix cache by adapter id.
                body = {"serialized_named_tensors": [serialize(bucket)] * tp, "flush_cache": False}
                response = yield Call("POST", "/update_weights_from_tensor", json=body)
                self._stream_result(response, "/update_weights_from_tensor", name)
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
