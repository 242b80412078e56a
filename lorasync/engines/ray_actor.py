"""Engines living in Ray actors: ``connect("ray", actor=handle)`` drives the lorasync engine an
actor hosts (the in-process vLLM, PEFT, or an HTTP client), as verl, NeMo RL, SkyRL and OpenRLHF
place their rollout engines.

The actor side is :class:`EngineHost` (use it as the actor class, subclass it, or give your own
actor a ``lorasync_call(method, *args)`` method that does what it does). The driver side is
:class:`RayEngine`, an ordinary :class:`~lorasync.engines.Engine`: ``Publisher`` and
``publish_adapter`` accept it like any other. An adapter crosses into Ray's object store once
per publish (``ray.put``; every Ray engine publishing the same adapter shares that one object) and
the actor loads it from there as tensors, no files. Errors raised in the actor come back as the
same typed ``lorasync.errors`` (they pickle); a dead or restarting actor is an
``EngineUnavailableError`` and the versions served elsewhere are untouched.

Why the adapter crosses as one buffer: an ``Adapter`` read from disk holds views of one file-sized
buffer, and pickling a view pickles its whole storage, so a plain ``ray.put(adapter)`` stored the
file once per tensor. :class:`_Packed` writes it once in lorasync's safetensors layout into a
numpy buffer (Ray keeps it out of band: one copy in the store, read zero-copy), and unpickles
straight into an ``Adapter`` in the actor, so any actor's ``lorasync_call`` receives one. The
shared reference is keyed by the Ray session too: one from before ``ray.shutdown()`` is never
handed out again.

A call that timed out is still running in the actor. A load that times out is remembered, and
the next call first waits for it and unloads the version if it landed after all, so the report
that called it failed stays true and publishing it again loads it afresh.

Needs ``pip install 'lorasync[ray]'``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from lorasync.engines._engine import Capabilities, Engine
from lorasync.errors import (
    AdapterNotFoundError,
    ConfigError,
    EngineError,
    EngineTimeoutError,
    EngineUnavailableError,
    LoraSyncError,
)

if TYPE_CHECKING:
    import numpy as np

    from lorasync.adapter._adapter import Adapter
    from lorasync.adapter._config import AdapterConfig

__all__ = ["EngineHost", "RayEngine"]

# What a driver may ask a hosted engine to do (nothing else is dispatched by name).
_METHODS = frozenset(
    {
        "adapter_sources",
        "capabilities",
        "load_adapter",
        "load_adapter_tensors",
        "unload_adapter",
        "list_adapters",
        "adapters_in_use",
        "greedy",
        "close",
    }
)

_LOADS = frozenset({"load_adapter", "load_adapter_tensors"})

_shared_lock = threading.Lock()
_shared: dict[tuple[str, tuple[str, str]], Any] = {}  # (content hash, Ray session) -> ObjectRef of the adapter published last


class EngineHost:
    """Actor class hosting one lorasync engine: ``ray.remote(EngineHost).remote("peft", base_model_path=...)``.

    Args:
        kind (`str`): the engine kind to connect inside the actor (``"peft"``, ``"vllm"``...).
        url (`str`): its URL, for HTTP engines.
        factory (`Callable[[], Engine]`, *optional*): builds the engine inside the actor instead
            (for engines holding objects that cannot travel, e.g.
            ``lambda: VLLMInProcessEngine(llm=vllm.LLM(...))``).
        **options: passed to ``connect``.
    """

    def __init__(self, kind: str = "", url: str = "", *, factory: Callable[[], Engine] | None = None, **options: Any) -> None:
        from lorasync.engines._registry import connect

        if factory is not None:
            engine = factory()
            if not isinstance(engine, Engine):
                raise ConfigError(f"factory must return a lorasync Engine, got {type(engine).__name__}")
            self.engine = engine
        elif kind:
            self.engine = connect(kind, url, **options)
        else:
            raise ConfigError("EngineHost needs an engine kind (e.g. 'peft') or factory=")

    def lorasync_call(self, method: str, *args: Any) -> Any:
        """Run ``method`` of the hosted engine; failures leave as typed ``lorasync.errors``."""
        if method not in _METHODS:
            raise ConfigError(f"EngineHost does not dispatch {method!r}; it serves {sorted(_METHODS)}")
        try:
            return getattr(self.engine, method)(*args)
        except LoraSyncError:
            raise
        except Exception as exc:  # a foreign error must not cross the boundary untyped
            raise EngineError(
                f"{self.engine.kind} in a Ray actor failed in {method}: {type(exc).__name__}: {exc}",
                engine=self.engine.kind,
            ) from exc

    def lorasync_node(self) -> str:
        """The Ray node this actor runs on (the driver compares it with its own)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())


class RayEngine(Engine):
    """Drive the lorasync engine hosted by a Ray actor.

    Args:
        actor: a Ray actor handle whose class has ``lorasync_call`` (e.g. :class:`EngineHost`).
        timeout (`float`): seconds one call may take (loads and verifications included).

    Raises:
        ConfigError: Ray is not installed or ``actor`` is not a lorasync host.

    Example:
        >>> host = ray.remote(EngineHost).options(max_restarts=1).remote("peft", base_model_path="/models/base")  # doctest: +SKIP
        >>> engine = connect("ray", actor=host)  # doctest: +SKIP
        >>> Publisher(engine, name="policy").publish(model, version=1)  # doctest: +SKIP
    """

    kind: ClassVar[str] = "ray"
    remote: ClassVar[bool | None] = True  # other processes may hold a handle to the same actor

    def __init__(self, *, actor: Any, timeout: float = 300.0) -> None:
        try:
            import ray  # noqa: F401
        except ImportError as exc:
            raise ConfigError("the Ray engine needs Ray: pip install 'lorasync[ray]'") from exc
        if not hasattr(actor, "lorasync_call"):
            raise ConfigError(
                f"actor {actor!r} has no lorasync_call method; host the engine with "
                "ray.remote(lorasync.engines.ray_actor.EngineHost) or add EngineHost's methods to your actor"
            )
        self.actor = actor
        self.timeout = timeout
        self._doubt: dict[str, Any] = {}  # served name -> ObjectRef of a load that timed out
        self._doubt_lock = threading.Lock()
        actor_id = getattr(actor, "_actor_id", None)
        self.url = f"ray-actor:{actor_id.hex() if actor_id is not None else id(actor)}"

    # -- the Engine protocol ----------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        """The hosted engine's capabilities, as seen from here: tensors travel through the object
        store (``in_process``: no files needed), files only when the actor shares this host.

        Raises:
            EngineUnavailableError: the actor is dead or restarting. EngineError: as hosted.
        """
        import ray

        hosted: Capabilities = self._call("capabilities")
        node = self._get(self.actor.lorasync_node.remote(), "lorasync_node")
        same_node = node == ray.get_runtime_context().get_node_id()
        return dataclasses.replace(
            hosted,
            engine=self.kind,
            url=self.url,
            same_host=same_node and hosted.same_host,
            in_process=hosted.tensor_load,  # tensors hand over directly, through the object store
            notes=(*hosted.notes, f"hosted engine: {hosted.engine} at {hosted.url or '(in-process)'}"),
        )

    def load_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        """Load the adapter directory ``path`` (on the actor's node) under ``name``."""
        self._call("load_adapter", name, os.path.abspath(os.fspath(path)))

    def load_adapter_tensors(self, name: str, adapter: Adapter) -> None:
        """Load ``adapter`` under ``name`` from Ray's object store (one ``ray.put`` per adapter)."""
        self._call("load_adapter_tensors", name, _put_once(adapter))

    def unload_adapter(self, name: str) -> None:
        self._call("unload_adapter", name)

    def list_adapters(self) -> list[str]:
        return list(self._call("list_adapters"))

    def adapter_sources(self) -> Mapping[str, str | None] | None:
        """The hosted engine's :meth:`Engine.adapter_sources` (a restarted actor's are new)."""
        answer = self._call("adapter_sources")
        return dict(answer) if answer is not None else None

    def adapters_in_use(self) -> frozenset[str] | None:
        answer = self._call("adapters_in_use")
        return frozenset(answer) if answer is not None else None

    def greedy(self, name: str | None, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        tokens, logprobs = self._call("greedy", name, list(prompt_ids), max_tokens)
        return list(tokens), list(logprobs)

    def close(self) -> None:
        """Leaves the actor running (it belongs to the caller); takes back a timed-out load that landed."""
        try:
            self._settle_doubts()
        except EngineError:
            pass  # best effort: the actor is busy or gone

    # -- the call ---------------------------------------------------------------------------------

    def _call(self, method: str, *args: Any) -> Any:
        self._settle_doubts()
        try:
            ref = self.actor.lorasync_call.remote(method, *args)
        except Exception as exc:
            raise self._translate(exc, method) from exc
        try:
            return self._get(ref, method)
        except EngineTimeoutError as exc:
            if method not in _LOADS:
                raise
            name = args[0]
            with self._doubt_lock:
                self._doubt[name] = ref
            raise EngineTimeoutError(
                f"{self.kind} {self.url}: loading {name} did not finish within {self.timeout}s and may still finish in "
                f"the actor; lorasync then unloads {name} before any later call reaches the actor, so it is not served "
                "and publishing it again loads it afresh. Raise timeout= if loads take this long",
                engine=self.kind,
                url=self.url,
                adapter=name,
            ) from exc

    def _settle_doubts(self) -> None:
        """Wait for loads that timed out earlier; unload what landed after all (see module docstring).

        Raises:
            EngineTimeoutError: such a load still runs after another ``timeout`` seconds.
        """
        import ray

        with self._doubt_lock:
            pending = dict(self._doubt)
        for name, ref in pending.items():
            ready, _ = ray.wait([ref], timeout=self.timeout)
            if not ready:
                raise EngineTimeoutError(
                    f"{self.kind} {self.url}: an earlier load of {name} is still running in the actor after another "
                    f"{self.timeout}s; nothing else is sent until it ends. Check the actor, or publish again later",
                    engine=self.kind,
                    url=self.url,
                    adapter=name,
                )
            with self._doubt_lock:
                self._doubt.pop(name, None)
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - it failed (or the actor died): nothing to take back
                continue
            try:
                self._get(self.actor.lorasync_call.remote("unload_adapter", name), "unload_adapter")
            except AdapterNotFoundError:
                pass  # someone unloaded it already

    def _get(self, ref: Any, method: str) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=self.timeout)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, LoraSyncError):
                raise cause from exc  # the hosted engine's own typed error, context included
            raise self._translate(exc, method) from exc
        except Exception as exc:
            raise self._translate(exc, method) from exc

    def _translate(self, exc: Exception, method: str) -> EngineError:
        import ray

        where = f"{self.kind} {self.url}: {method}"
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            return EngineTimeoutError(
                f"{where} did not answer within {self.timeout}s; raise timeout= or check the actor", engine=self.kind, url=self.url
            )
        if isinstance(exc, ray.exceptions.RayActorError) and getattr(exc, "actor_init_failed", False):
            return EngineUnavailableError(
                f"{where} failed: the actor's constructor raised {_creation_error(exc)}, so it never hosted an engine; "
                "fix that and create the actor again",
                engine=self.kind,
                url=self.url,
            )
        if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
            return EngineUnavailableError(
                f"{where} failed: the actor is dead or restarting ({type(exc).__name__}); the versions other engines "
                "serve are unchanged. Restart the actor (max_restarts=) and publish again",
                engine=self.kind,
                url=self.url,
            )
        return EngineError(f"{where} failed: {type(exc).__name__}: {exc}", engine=self.kind, url=self.url)

    def __repr__(self) -> str:
        return f"RayEngine(url={self.url!r})"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _creation_error(exc: Exception) -> str:
    """The exception an actor's ``__init__`` raised (its last traceback line: ``ConfigError: ...``)."""
    text = _ANSI.sub("", str(getattr(exc, "error_msg", "") or exc))
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith(("File ", "^"))]
    last = lines[-1] if lines else type(exc).__name__
    return re.sub(r"^(?:[A-Za-z_][\w]*\.)+(?=[A-Za-z_]\w*(?:Error|Exception)\b)", "", last)


def _session() -> tuple[str, str]:
    """This driver's Ray session: a fresh cluster has another node, a reconnect another job."""
    import ray

    context = ray.get_runtime_context()
    return context.get_node_id(), context.get_job_id()


class _Packed:
    """An adapter as it crosses Ray's object store: one safetensors-layout buffer plus its config.

    Pickles (with Ray's protocol 5, the buffer out of band) into :func:`_unpack`, so whoever gets
    it from the store gets an ``Adapter``, every tensor in memory of its own.
    """

    __slots__ = ("buffer", "config")

    def __init__(self, adapter: Adapter) -> None:
        import numpy as np
        import torch

        from lorasync.wire.layout import plan

        layout = plan(adapter.tensors, {}, grouped=False)
        self.buffer = np.empty(layout.total, dtype=np.uint8)
        layout.write_into(torch.from_numpy(self.buffer), list(adapter.tensors.values()))
        self.config = adapter.config

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpack, (self.buffer, self.config))


def _unpack(buffer: np.ndarray, config: AdapterConfig) -> Adapter:
    from lorasync.adapter._adapter import Adapter
    from lorasync.wire.reading import read

    tensors, _ = read(buffer, what="adapter from Ray's object store")
    return Adapter(tensors, config)


def _put_once(adapter: Adapter) -> Any:
    """The adapter's object-store reference, put once for every Ray engine of one publish."""
    import ray

    if not ray.is_initialized():
        ray.init()  # what ray.put would do; the session must be known before the lookup
    key = (adapter.content_hash, _session())
    with _shared_lock:
        ref = _shared.get(key)
        if ref is None:
            _shared.clear()  # keep only the adapter being published: the store frees older ones
            ref = _shared[key] = ray.put(_Packed(adapter))
    return ref
