"""A vLLM server managed by AIBrix: adapters load and unload through AIBrix's runtime sidecar
(engine kind ``aibrix``).

AIBrix (pip ``aibrix``, its ``aibrix_runtime`` process) runs beside vLLM in each pod and is how
its control plane (``ModelAdapter``) loads LoRA adapters: ``POST /v1/lora_adapter/load`` with
``{"lora_name", "lora_path"}`` and ``POST /v1/lora_adapter/unload``, forwarded to vLLM's runtime
routes. Requests go to vLLM (or AIBrix's gateway) as usual. Facts of aibrix 0.8.0, read from its
source and run against a vLLM CPU 0.32 server (``tests/engines/test_aibrix.py``):

* The sidecar refuses names outside ``[A-Za-z0-9_-]`` (at most 100 characters). lorasync serves
  ``name@vN``, so through AIBrix each version is served as :func:`request_name` of it, an
  injective spelling in that alphabet (``policy@v3`` → ``policy_v3``; ``_`` is written ``__`` and
  ``.`` ``_d``). Reports, leases and listings keep lorasync's names; requests name the adapter
  ``request_name(report.served_name)``. A plain name that reads as such a spelling is refused,
  so no two names share one.
* Its unload answers 200 ``success`` even where vLLM answered 404 (it logs the engine's error and
  goes on), and a body of only ``lora_name`` is taken as its "unload with local cleanup" form. So
  lorasync asks with ``cleanup_local: false`` (nothing of lorasync's is its to delete) and
  believes vLLM's model list, before and after, instead of the answer.
* A load answers vLLM's own status with vLLM's message inside its own, except that it turns
  every 404 into "LoRA path ... not found" (vLLM's own route then says whether runtime loading is
  off) and retries a 5xx, then answers its own text without vLLM's reason (a rank over the
  server's maximum is still told apart, from ``adapter_config.json``). It also retries a load
  that outlasts its 30 s read timeout, which then answers "already loaded": so lorasync lists
  the server before each load (a name listed then is another load's) and after (the load counts
  once the server lists it from this path). It has no tensor route (``load_inplace`` and other
  fields are refused), so adapters travel as files: the disk transport.
* Which server: its ``/v1/models`` is vLLM's, proxied, so lorasync refuses a sidecar whose base
  models differ from the server's; a sidecar of a replica (the same base model) is caught at its
  first load, which the server does not list (taken out there again, ``ConfigError``).
* It asks no key and reaches vLLM with its own (``INFERENCE_ENGINE_API_KEY``): lorasync's key goes
  to vLLM only, and a 401 it relays says to start the sidecar with that variable.

Everything else (capabilities, listings, ``/metrics`` in-flight readings, verification requests)
is the :class:`~lorasync.engines.vllm.VLLMEngine` client's, on the vLLM server's URL.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Generator, Mapping, Sequence
from typing import Any, TypeVar

import httpx

from lorasync.adapter._names import parse_served_name
from lorasync.engines._aibrix_names import UNMANAGED_MARK, request_name, served_from_request
from lorasync.engines._aibrix_sidecar import SIDECAR_LOAD, SIDECAR_READY, SIDECAR_UNLOAD, Sidecar, bases, config_rank, default_sidecar
from lorasync.engines._engine import Capabilities
from lorasync.engines._http import Call, HTTPEngine, Operation, body_text
from lorasync.engines.vllm._bodies import Completion
from lorasync.engines.vllm._client import VLLMEngine
from lorasync.engines.vllm._errors import disabled, generic, load_error, message_of, route_missing
from lorasync.engines.vllm._protocol import LOAD_ROUTE, MODELS_ROUTE
from lorasync.engines.vllm import _releases
from lorasync.errors import (
    AdapterAlreadyLoadedError,
    AdapterNotFoundError,
    CapabilityError,
    ConfigError,
    EngineProtocolError,
    RankTooLargeError,
)

__all__ = ["AIBrixEngine", "request_name", "served_from_request"]

T = TypeVar("T")

# A step of an AIBrix operation: which client runs which operation; the answer is sent back.
Step = Generator[tuple[HTTPEngine, Operation[Any]], Any, T]


class AIBrixEngine(VLLMEngine):
    """A vLLM server whose adapters load and unload through AIBrix's runtime sidecar.

    Args:
        url (`str`, defaults to ``"http://127.0.0.1:8000"``): the vLLM server (listings,
            capabilities, ``/metrics``, verification requests).
        sidecar (`str`, *optional*): the ``aibrix_runtime`` URL; default the server's host on
            port 8080 (AIBrix's default). The API key (``api_key`` / ``api_key_env``) goes to vLLM
            only: the sidecar reaches vLLM with its own ``INFERENCE_ENGINE_API_KEY``.
        **options: :class:`~lorasync.engines.vllm.VLLMEngine` options (``api_key``,
            ``api_key_env``, ``timeout``, ``retries``, ``max_rank``, ``max_loras``, ``same_host``).

    Requests select a version with ``model=request_name(report.served_name)``.

    Example:
        >>> pub = Publisher(["aibrix:http://pod:8000"], name="policy")  # doctest: +SKIP
        >>> report = pub.publish(adapter, version=3)  # doctest: +SKIP
        >>> request_name(report.served_name)  # doctest: +SKIP
        'policy_v3'
    """

    kind = "aibrix"

    def __init__(self, url: str = "http://127.0.0.1:8000", *, sidecar: str | None = None, **options: Any) -> None:
        super().__init__(url, **options)
        if sidecar is not None and (not isinstance(sidecar, str) or not sidecar.strip()):
            raise ConfigError(f"sidecar must be the AIBrix runtime's URL (http://host:8080) or left out, got {sidecar!r}")
        self._sidecar = Sidecar(
            sidecar if sidecar is not None else default_sidecar(self.url),
            timeout=self.timeout,
            retries=self.retry,
            # The caller's own I/O (tests, proxies, sockets) carries the sidecar's requests too.
            transport=options.get("transport"),
            async_transport=options.get("async_transport"),
        )

    @property
    def sidecar_url(self) -> str:
        """The AIBrix runtime sidecar this engine loads through."""
        return self._sidecar.url

    def close(self) -> None:
        try:
            self._sidecar.close()
        finally:
            super().close()

    async def aclose(self) -> None:
        try:
            await self._sidecar.aclose()
        finally:
            await super().aclose()

    # -- the operations that go through the sidecar, or name adapters -------------------------------

    def capabilities(self) -> Capabilities:
        """vLLM's capabilities as the sidecar allows them: files only (no tensor loads, in-place
        swaps or merged updates through AIBrix).

        Raises:
            ConfigError: the sidecar drives another vLLM server. EngineUnavailableError: it or the
                server does not answer. The rest as :meth:`VLLMEngine.capabilities`.
        """
        return self._drive(self._aibrix_capabilities())

    async def acapabilities(self) -> Capabilities:
        return await self._adrive(self._aibrix_capabilities())

    def load_adapter(self, name: str, path: str | os.PathLike[str], *, load_inplace: bool = False) -> None:
        """Load the adapter directory ``path`` under ``name`` through the sidecar (served as
        :func:`request_name` of it).

        Raises:
            InvalidNameError: a name AIBrix cannot take. ConfigError: ``load_inplace`` (the
                sidecar has no such field). The rest as :meth:`VLLMEngine.load_adapter`.
        """
        self._drive(self._aibrix_load(name, path, load_inplace), adapter=name)

    async def aload_adapter(self, name: str, path: str | os.PathLike[str], *, load_inplace: bool = False) -> None:
        await self._adrive(self._aibrix_load(name, path, load_inplace), adapter=name)

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name`` through the sidecar; vLLM's model list says whether it did.

        Raises:
            AdapterNotFoundError: vLLM does not list it. EngineProtocolError: still listed after
                the sidecar's "success". The rest as :meth:`VLLMEngine.unload_adapter`.
        """
        self._drive(self._aibrix_unload(name), adapter=name)

    async def aunload_adapter(self, name: str) -> None:
        await self._adrive(self._aibrix_unload(name), adapter=name)

    def _load(self, name: str, path: str | os.PathLike[str], load_inplace: bool) -> Operation[None]:
        raise CapabilityError(f"{self.kind} at {self.url}: loads go through the AIBrix sidecar (load_adapter)")

    def _load_tensors(self, name: str, adapter: Any) -> Operation[None]:
        raise CapabilityError(
            f"{self.kind} at {self.url}: AIBrix's sidecar loads adapters from files only; publish with transport='disk' "
            "(the default picks it)"
        )
        yield  # pragma: no cover - makes this an operation

    def _update_weights(self, named_tensors: Mapping[str, Any]) -> Operation[None]:
        raise CapabilityError(f"{self.kind} at {self.url}: merged weight updates do not go through AIBrix")
        yield  # pragma: no cover

    def _roots(self) -> Operation[dict[str, str | None]]:
        roots = yield from super()._roots()
        return {served_from_request(wire): root for wire, root in roots.items()}

    def _in_use(self) -> Operation[frozenset[str] | None]:
        names = yield from super()._in_use()
        return None if names is None else frozenset(served_from_request(n) for n in names)

    def _generate(self, prompt: Sequence[int], model: str, max_tokens: int, logprobs: int | None, ignore_eos: bool) -> Operation[Completion]:
        if isinstance(model, str) and model.endswith(UNMANAGED_MARK):
            wire = model[: -len(UNMANAGED_MARK)]  # listed so, to stay foreign: asked for as vLLM lists it
        else:
            wire = request_name(model) if parse_served_name(model) is not None else model
        return (yield from super()._generate(prompt, wire, max_tokens, logprobs, ignore_eos))

    # -- steps (each runs one operation on one client) ------------------------------------------

    def _aibrix_capabilities(self) -> Step[Capabilities]:
        caps = yield self, super()._capabilities()
        ready = yield self._sidecar, self._sidecar._ask("GET", SIDECAR_READY)
        if ready.status_code != 200:
            raise generic(self._sidecar, ready, SIDECAR_READY, None, message_of(ready), "the readiness check")
        # Its /v1/models is the server's it drives: the base models and their roots must be ours.
        theirs = yield self._sidecar, self._sidecar._ask("GET", MODELS_ROUTE)
        ours = yield self, self._ask_models()
        if bases(theirs) != bases(ours):
            raise ConfigError(
                f"the AIBrix sidecar at {self._sidecar.url} drives a vLLM serving {sorted(bases(theirs))}, not the server at "
                f"{self.url} ({sorted(bases(ours))}); give the sidecar of that server (sidecar=...)"
            )
        return dataclasses.replace(
            caps,
            engine=self.kind,
            tensor_load=False,
            device_tensors=False,
            weight_update=False,
            load_inplace=False,
            notes=(*caps.notes, f"adapters load through the AIBrix sidecar at {self._sidecar.url}, from files; requests name "
                   "them request_name(served_name)"),
        )

    def _ask_models(self) -> Operation[httpx.Response]:
        return (yield Call("GET", MODELS_ROUTE))

    def _aibrix_load(self, name: str, path: str | os.PathLike[str], load_inplace: bool) -> Step[None]:
        if not name:
            raise ConfigError("adapter name must be a non-empty string")
        if load_inplace:
            raise ConfigError("AIBrix's sidecar has no in-place load; publish versioned names (the default)")
        wire = request_name(name)
        lora_path = os.path.abspath(os.fspath(path))
        self.refuse_extra_weights(name, lora_path, SIDECAR_LOAD)
        # What this server serves before: a name it lists is another load's (the sidecar retries a
        # load on its own, so "already loaded" after the request may be this one landing).
        before = yield self, super()._roots()
        if wire in before:
            raise self._already(name, wire, before[wire])
        if name in self._unloaded:  # vLLM before 0.34 would take the new LoRA id for the old one's
            yield self, _releases.refuse_name_in_use(name, kind=self.kind, url=self.url, in_use=self._in_use)
        response = yield self._sidecar, self._sidecar._ask("POST", SIDECAR_LOAD, {"lora_name": wire, "lora_path": lora_path})
        message = message_of(response)
        if response.status_code == 200 or "has already been loaded" in message:
            # Its answer says a vLLM took it; the server this engine reads must list it, from this path.
            after = yield self, super()._roots()
            if wire in after and after[wire] in (None, lora_path):
                self._unloaded.discard(name)
                return
            if response.status_code != 200:
                raise self._already(name, wire, after.get(wire))
            if body_text(response).startswith("Success"):
                # Loaded, but not into this server: the sidecar drives another one (a replica).
                yield self._sidecar, self._sidecar._ask("POST", SIDECAR_UNLOAD, {"lora_name": wire, "cleanup_local": False})
                raise ConfigError(
                    f"the AIBrix sidecar at {self._sidecar.url} loaded {name!r} into a vLLM other than the server at {self.url}, "
                    "which does not list it (taken out there again); give the sidecar of that server (sidecar=...)"
                )
            raise EngineProtocolError(
                f"{self.kind}: the sidecar at {self._sidecar.url} answered the load of {name!r} with HTTP 200 but "
                f"{body_text(response)[:200]!r}, and vLLM at {self.url} does not list it; the adapter is not served",
                **self._sidecar.error_context(SIDECAR_LOAD, name, response),
            )
        if route_missing(response):  # FastAPI's own 404: no such route, so not AIBrix's runtime there
            raise ConfigError(
                f"{self._sidecar.url} has no {SIDECAR_LOAD} route: is it AIBrix's runtime sidecar (aibrix_runtime, port 8080 by "
                "default)? Give its URL as sidecar=..."
            )
        if response.status_code == 404:
            # The sidecar answers any 404 of vLLM's as "LoRA path ... not found": vLLM's own route
            # says whether runtime loading is off there.
            route = yield self, self._ask_route()
            if route_missing(route):
                raise disabled(self, route, LOAD_ROUTE, name)
            raise AdapterNotFoundError(
                f"the AIBrix sidecar at {self._sidecar.url} found no adapter at {lora_path} ({message}); the directory must "
                "exist on the server's host and hold adapter_config.json and adapter_model.safetensors",
                path=lora_path,
                **self._sidecar.error_context(SIDECAR_LOAD, name, response),
            )
        if response.status_code >= 500 and "has already" not in message:
            # The sidecar retries vLLM's 5xx and then answers its own text, vLLM's reason dropped:
            # the one refusal lorasync can tell from here is a rank over the server's maximum.
            caps = yield self, super()._capabilities()
            rank = config_rank(lora_path) if self.same_host else None  # a remote server's files are not these
            if rank is not None and caps.max_rank is not None and rank > caps.max_rank:
                raise RankTooLargeError(
                    f"{self.kind} at {self.url} refused adapter {name!r}: its rank {rank} is over the server's max_lora_rank "
                    f"{caps.max_rank}; restart vLLM with a larger --max-lora-rank or train/trim the adapter to r <= {caps.max_rank}",
                    rank=rank,
                    max_rank=caps.max_rank,
                    **self._sidecar.error_context(SIDECAR_LOAD, name, response),
                )
        raise load_error(self._sidecar, response, name, lora_path, message, route=SIDECAR_LOAD)

    def _already(self, name: str, wire: str, root: str | None) -> AdapterAlreadyLoadedError:
        return AdapterAlreadyLoadedError(
            f"{self.kind} at {self.url} already serves an adapter named {name!r} (as {wire!r}, from {root}); publish under "
            "a new versioned name or unload it first (AIBrix has no in-place load)",
            engine=self.kind,
            url=f"{self._sidecar.url}{SIDECAR_LOAD}",
            adapter=name,
        )

    def _ask_route(self) -> Operation[httpx.Response]:
        return (yield Call("GET", LOAD_ROUTE, retry=False))

    def _aibrix_unload(self, name: str) -> Step[None]:
        if not name:
            raise ConfigError("adapter name must be a non-empty string")
        wire = request_name(name)
        before = yield self, super()._roots()
        if wire not in before:
            raise AdapterNotFoundError(
                f"{self.kind} at {self.url} does not serve adapter {name!r} (as {wire!r}); list_adapters() shows what it serves",
                engine=self.kind,
                url=f"{self.url}{MODELS_ROUTE}",
                adapter=name,
            )
        response = yield self._sidecar, self._sidecar._ask("POST", SIDECAR_UNLOAD, {"lora_name": wire, "cleanup_local": False})
        if response.status_code != 200:
            raise generic(self._sidecar, response, SIDECAR_UNLOAD, name, message_of(response), f"unload of adapter {name!r}")
        after = yield self, super()._roots()
        if wire in after:
            raise EngineProtocolError(
                f"{self.kind}: the sidecar at {self._sidecar.url} answered the unload of {name!r} with "
                f"{body_text(response)[:200]!r}, and vLLM at {self.url} still lists it (the sidecar answers success "
                "whatever vLLM said; its log has vLLM's answer); call unload_adapter again",
                **self._sidecar.error_context(SIDECAR_UNLOAD, name, response),
            )
        self._unloaded.add(name)

    # -- drivers: each step's operation on its client, sync or async -----------------------------

    def _drive(self, step: Step[T], *, adapter: str | None = None) -> T:
        answer: Any = None
        try:
            while True:
                client, op = step.send(answer)
                answer = client._run(op, adapter=adapter)
        except StopIteration as stop:
            return stop.value

    async def _adrive(self, step: Step[T], *, adapter: str | None = None) -> T:
        answer: Any = None
        try:
            while True:
                client, op = step.send(answer)
                answer = await client._arun(op, adapter=adapter)
        except StopIteration as stop:
            return stop.value
