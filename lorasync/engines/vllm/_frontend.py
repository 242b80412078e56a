"""What lorasync installs on an in-process vLLM's frontend, once per ``LLM`` / ``AsyncLLM``.

Every :class:`~lorasync.engines.vllm.inprocess.VLLMInProcessEngine` over one vLLM shares one
:class:`Frontend`, kept on the engine core object. It holds three rules no engine object could
keep alone:

* **One sender at a time** (sync ``vllm.LLM``). The caller's ``llm.generate`` and lorasync's
  ``add_lora`` / ``collective_rpc`` share one ZeroMQ socket and one message encoder; two threads
  sending at once abort the process (libzmq asserts ``!_current_out``, SIGABRT). The frontend
  wraps the engine core client's send (``_send_input``, vLLM 0.32's ``SyncMPClient``; every public
  method of another client) in one lock, so the caller's own calls go through it without any
  change to their code. Where that is impossible (an unknown vLLM), :meth:`Frontend.check_idle`
  refuses lorasync's calls while requests are in flight, with a typed error, instead.
* **A retired version is refused at admission.** vLLM rebuilds an adapter evicted from its LoRA
  cache from its ``LoRARequest`` for as long as some request names it, even after lorasync
  unloaded it and freed its source; that kills the engine core. A ``LoRARequest`` from
  ``engine.lora_request(name)`` kept past the version's retirement is refused when it is
  submitted: the output processor's ``add_request`` raises :func:`retired_error` (a lorasync
  ``AdapterNotFoundError`` that is also vLLM's own not-found client error), a normal per-request
  error, and the engine keeps serving.
* **A version's source stays while a request may need it.** Staged tensors of an unloaded version
  are released only once no admitted request names it (:meth:`Frontend.retire` and
  :meth:`Frontend.releasable`); retirement forced by ``drain_timeout`` / ``max_deferred`` under a
  running request no longer takes the weights from under it. Admission and that check take one
  lock, so no request slips in between.
* **A name is loaded again only when vLLM can tell the versions apart.** Before 0.34 vLLM's
  ``LoRARequest`` equality is the name alone, and a batch collects its requests in a set: a name
  loaded again (a new LoRA id) while requests of its unloaded version (the old id) still run
  would be one adapter to vLLM. :meth:`Frontend.check_name_free` refuses that load.

Tested against vLLM 0.32 (``SyncMPClient``, ``OutputProcessor.add_request``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from lorasync.errors import AdapterNotFoundError, ConfigError

__all__ = ["Frontend", "retired_error"]

_ATTR = "_lorasync_frontend"
_INSTALL = threading.Lock()


class Frontend:
    """lorasync's hooks on one vLLM frontend (see the module docstring); get it with :meth:`of`.

    Args:
        core: the ``LLMEngine`` of a ``vllm.LLM``, or the ``AsyncLLM`` itself.
        is_async (`bool`): an ``AsyncLLM`` (its calls are serialised on its own event loop).
    """

    def __init__(self, core: Any, *, is_async: bool) -> None:
        self._core = core
        self._admit = threading.Lock()  # admission vs. the retire/release decision
        self.send_lock = threading.RLock()  # one sender into a sync LLM's engine core
        self.driver_lock = threading.RLock()  # one thread stepping a sync LLM (engine.lock)
        self._gone: dict[int, str] = {}  # LoRA id -> served name, unloaded by lorasync
        self._pending: dict[int, str] = {}  # LoRA id -> staging token kept for a running request
        self.serialised = is_async or self._serialise_sends(getattr(core, "engine_core", None))
        self.gated = self._gate_admission(getattr(core, "output_processor", None))

    @classmethod
    def of(cls, core: Any, *, is_async: bool) -> Frontend:
        """The frontend of ``core``, installed on first use (thread-safe)."""
        with _INSTALL:
            frontend = getattr(core, _ATTR, None)
            if not isinstance(frontend, Frontend):
                frontend = cls(core, is_async=is_async)
                setattr(core, _ATTR, frontend)
            return frontend

    # -- one sender ---------------------------------------------------------------------------

    def _serialise_sends(self, client: Any) -> bool:
        if client is None:
            return False
        lock = self.send_lock
        if callable(getattr(client, "_send_input", None)):
            names = ["_send_input"]  # SyncMPClient: every call into the engine core sends through it
        elif type(client).__name__ == "InprocClient":  # VLLM_ENABLE_V1_MULTIPROCESSING=0: calls run the core
            names = [n for n in vars(type(client)) if not n.startswith("_") and n != "shutdown" and callable(getattr(client, n))]
        else:
            return False
        for name in names:
            original = getattr(client, name)

            @functools.wraps(original)
            def locked(*args: Any, __original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                with lock:
                    return __original(*args, **kwargs)

            setattr(client, name, locked)
        return True

    def check_idle(self, kind: str, *, stepping: bool = False) -> None:
        """Refuse a call into a sync LLM that would overlap the caller's own ``llm.generate``:
        any call when lorasync could not serialise the sends, and (``stepping``) a generation of
        lorasync's own (a sync LLM has one driver: two threads stepping it take each other's outputs).

        Raises:
            ConfigError: the LLM is generating in another thread right now.
        """
        if (self.serialised and not stepping) or not self._requests():
            return
        if stepping:
            raise ConfigError(
                f"{kind}: verification generates through the LLM, which is generating in another thread right "
                "now, and a vllm.LLM has one driver; hold engine.lock around your llm.generate calls (lorasync "
                "then waits for them), or publish without verify="
            )
        raise ConfigError(
            f"{kind}: this vLLM's engine core client cannot be shared between threads, and the LLM is generating "
            "right now; publish between llm.generate calls (from the thread that generates), or use an AsyncLLM"
        )

    # -- admission and the sources of retired versions ----------------------------------------

    def _gate_admission(self, processor: Any) -> bool:
        original = getattr(processor, "add_request", None)
        if not callable(original):
            return False

        @functools.wraps(original)
        def add_request(request: Any, *args: Any, **kwargs: Any) -> Any:
            lora = getattr(request, "lora_request", None)
            with self._admit:
                name = self._gone.get(getattr(lora, "lora_int_id", None)) if lora is not None else None
                if name is not None:
                    raise retired_error(name, getattr(request, "request_id", "?"))
                return original(request, *args, **kwargs)

        processor.add_request = add_request
        return True

    def _requests(self) -> dict[str, Any]:
        states = getattr(getattr(self._core, "output_processor", None), "request_states", None)
        return states if isinstance(states, dict) else {}

    def _in_flight_ids(self) -> set[Any]:
        """LoRA ids of the requests the output processor tracks (waiting, running, streaming out)."""
        states = self._requests()
        for _ in range(5):  # the engine's thread may finish requests while we read
            try:
                return {getattr(getattr(s, "lora_request", None), "lora_int_id", None) for s in list(states.values())} - {None}
            except RuntimeError:
                continue
        return set(self._gone) | set(self._pending)  # unreadable: assume every retired version is in use

    def check_name_free(self, name: str, *, kind: str, url: str, version: str | None) -> None:
        """Refuse to load ``name`` while a request naming it (an earlier LoRA id: lorasync does not
        serve it now) runs, on a release that compares ``LoRARequest``s by name alone.

        Raises:
            AdapterAlreadyLoadedError: such a request is in flight (it says what to do).
        """
        from lorasync.engines.vllm._lora_compat import rules_for
        from lorasync.engines.vllm._releases import reused_name_error

        if rules_for(version).request_identity_has_id:
            return
        states = self._requests()
        for _ in range(5):  # the engine's thread may finish requests while we read
            try:
                names = {getattr(getattr(s, "lora_request", None), "lora_name", None) for s in list(states.values())}
                break
            except RuntimeError:
                continue
        else:
            names = set(self._gone.values())  # unreadable: every retired name may still run
        if name in names:
            raise reused_name_error(kind, url, name, version)

    def retire(self, lora_id: int, name: str) -> None:
        """Refuse new requests for ``lora_id`` from now on (lorasync unloads it)."""
        with self._admit:
            self._gone[lora_id] = name

    def unretire(self, lora_id: int) -> None:
        """The unload failed: ``lora_id`` still serves."""
        with self._admit:
            self._gone.pop(lora_id, None)

    def keep_or_release(self, lora_id: int, token: str | None) -> str | None:
        """The staging token to release now for an unloaded ``lora_id``, or None when a request
        admitted earlier still names it (then it is kept until :meth:`releasable` hands it out)."""
        if token is None:
            return None
        with self._admit:
            if lora_id in self._in_flight_ids():
                self._pending[lora_id] = token
                return None
        return token

    def releasable(self) -> list[str]:
        """Tokens of unloaded versions whose last request finished (taken off the pending list)."""
        if not self._pending:
            return []
        with self._admit:
            busy = self._in_flight_ids()
            free = [i for i in self._pending if i not in busy]
            return [self._pending.pop(i) for i in free]

    @property
    def pending(self) -> bool:
        return bool(self._pending)


@functools.cache
def _retired_class() -> type[AdapterNotFoundError]:
    from lorasync.engines.vllm._surface import resolve
    from lorasync.errors import CapabilityError

    try:
        VLLMNotFoundError = resolve("VLLMNotFoundError")  # noqa: N806 - vLLM >= 0.2x: a client error, re-raised as is
    except CapabilityError:
        return AdapterNotFoundError

    class RetiredAdapterError(AdapterNotFoundError, VLLMNotFoundError):  # type: ignore[misc]
        """A request for an adapter version lorasync retired: lorasync's and vLLM's not-found error."""

    return RetiredAdapterError


def retired_error(name: str, request_id: str) -> AdapterNotFoundError:
    """The error a request for retired version ``name`` gets (at ``llm.generate``)."""
    return _retired_class()(
        f"request {request_id}: adapter {name!r} was retired by lorasync (it left the retention window and was "
        "unloaded), so vLLM could no longer build it; ask engine.lora_request(report.served_name) for a version "
        "that is served, or keep a version with Publisher.pin / lease while rollouts use it",
        engine="vllm-inprocess",
        adapter=name,
    )
