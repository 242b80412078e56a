"""Engines for tests: ``FakeEngine`` (every operation calls your function) and ``MemoryEngine``
(a real, if tiny, engine that keeps adapters in a dict).

``FakeEngine`` is to engines what ``httpx.MockTransport`` is to transports: a test states the
engine's behaviour as one plain function instead of patching a client. ``MemoryEngine`` reads
adapters from disk exactly like a server would (so a publisher's files are really checked), holds
a fixed number of them, and can be told to fail the next call of an operation.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from lorasync.adapter._adapter import ADAPTER_CONFIG, Adapter
from lorasync.engines._engine import Capabilities, Engine
from lorasync.engines._inflight import InFlight
from lorasync.errors import (
    AdapterAlreadyLoadedError,
    AdapterNotFoundError,
    AdapterRejectedError,
    CapacityError,
    ConfigError,
    InvalidNameError,
    LoraSyncError,
)

if TYPE_CHECKING:
    import torch

__all__ = ["EngineCall", "FakeEngine", "MemoryEngine"]

Handler = Callable[..., Any]


@dataclass(frozen=True)
class EngineCall:
    """One recorded engine operation: its name and keyword arguments."""

    op: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)


class FakeEngine(Engine):
    """An Engine whose every operation is ``handler(op, **kwargs)``.

    ``op`` is the method name without the ``a`` prefix: ``"capabilities"``, ``"load_adapter"``
    (``name``, ``path``), ``"unload_adapter"`` (``name``), ``"list_adapters"``,
    ``"load_adapter_tensors"`` (``name``, ``adapter``), ``"update_weights"``
    (``named_tensors``), ``"close"``. The handler's return value is the method's; ``None`` from
    ``capabilities`` / ``list_adapters`` means ``Capabilities(engine="fake")`` / ``[]``. Whatever
    it raises propagates unchanged, so a test can inject any error. The handler may be ``async``:
    async twins await it, sync methods run it to completion (outside a running event loop).

    Args:
        handler (`Callable[..., Any]`): ``handler(op, **kwargs)``, sync or async.
        url (`str`, defaults to ``"fake://"``): shown in reprs and capabilities.

    Attributes:
        calls (`list[EngineCall]`): every operation in call order, sync and async alike.

    Example:
        >>> def handler(op, **kw):
        ...     return ["policy@v1"] if op == "list_adapters" else None
        >>> engine = FakeEngine(handler)
        >>> engine.list_adapters()
        ['policy@v1']
        >>> [c.op for c in engine.calls]
        ['list_adapters']
    """

    kind = "fake"

    def __init__(self, handler: Handler, *, url: str = "fake://") -> None:
        if not callable(handler):
            raise ConfigError(f"FakeEngine needs a callable handler(op, **kwargs), got {handler!r}")
        self._handler = handler
        self.url = url
        self.calls: list[EngineCall] = []
        self._calls_lock = threading.Lock()

    def _record(self, op: str, kwargs: dict[str, Any]) -> Any:
        with self._calls_lock:
            self.calls.append(EngineCall(op, MappingProxyType(dict(kwargs))))
        return self._handler(op, **kwargs)

    def _call(self, op: str, **kwargs: Any) -> Any:
        result = self._record(op, kwargs)
        if inspect.isawaitable(result):
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return asyncio.run(_wait(result))
            _close(result)
            raise ConfigError(
                f"FakeEngine.{op}() was called inside a running event loop with an async handler; "
                f"call the async twin a{op}() instead"
            )
        return result

    async def _acall(self, op: str, **kwargs: Any) -> Any:
        result = self._record(op, kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    # -- sync ---------------------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        """``handler("capabilities")``, or ``Capabilities(engine="fake")`` for None."""
        return self._caps(self._call("capabilities"))

    def load_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        """``handler("load_adapter", name=name, path=path)``."""
        self._call("load_adapter", name=name, path=path)

    def unload_adapter(self, name: str) -> None:
        """``handler("unload_adapter", name=name)``."""
        self._call("unload_adapter", name=name)

    def list_adapters(self) -> list[str]:
        """``handler("list_adapters")`` as a list (None → ``[]``)."""
        return list(self._call("list_adapters") or [])

    def load_adapter_tensors(self, name: str, adapter: Adapter) -> None:
        """``handler("load_adapter_tensors", name=name, adapter=adapter)``."""
        self._call("load_adapter_tensors", name=name, adapter=adapter)

    def adapters_in_use(self) -> frozenset[str] | None:
        """``handler("adapters_in_use")`` as a frozenset (None → no request runs)."""
        result = self._call("adapters_in_use")
        return frozenset(result) if result is not None else frozenset()

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """``handler("update_weights", named_tensors=named_tensors)``."""
        self._call("update_weights", named_tensors=named_tensors)

    def close(self) -> None:
        """``handler("close")``."""
        self._call("close")

    # -- async --------------------------------------------------------------------------------

    async def acapabilities(self) -> Capabilities:
        return self._caps(await self._acall("capabilities"))

    async def aload_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        await self._acall("load_adapter", name=name, path=path)

    async def aunload_adapter(self, name: str) -> None:
        await self._acall("unload_adapter", name=name)

    async def alist_adapters(self) -> list[str]:
        return list(await self._acall("list_adapters") or [])

    async def aadapters_in_use(self) -> frozenset[str] | None:
        result = await self._acall("adapters_in_use")
        return frozenset(result) if result is not None else frozenset()

    async def aload_adapter_tensors(self, name: str, adapter: Adapter) -> None:
        await self._acall("load_adapter_tensors", name=name, adapter=adapter)

    async def aupdate_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        await self._acall("update_weights", named_tensors=named_tensors)

    async def aclose(self) -> None:
        await self._acall("close")

    def _caps(self, result: Any) -> Capabilities:
        if result is None:
            return Capabilities(engine=self.kind, url=self.url)
        if not isinstance(result, Capabilities):
            raise ConfigError(
                f"the FakeEngine handler returned {result!r} for 'capabilities'; return a Capabilities or None"
            )
        return result


async def _wait(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def _close(awaitable: Any) -> None:
    close = getattr(awaitable, "close", None)  # silence "coroutine was never awaited"
    if callable(close):
        close()


class MemoryEngine(Engine):
    """A small in-memory engine: adapters read from PEFT directories into a dict.

    Loads go through :meth:`lorasync.Adapter.load`, so a missing or corrupt directory fails the
    way it would on a server; once loaded, the files are no longer needed. Weight updates are
    kept in :attr:`weights`.

    Args:
        url (`str`, defaults to ``"memory://"``): shown in reprs and capabilities.
        max_loras (`int`, *optional*): capacity; a load beyond it raises ``CapacityError``.
        max_rank (`int`, *optional*): larger ranks raise ``RankTooLargeError``.
        tensor_load (`bool`, defaults to `True`): support ``load_adapter_tensors``.
        weight_update (`bool`, defaults to `True`): support ``update_weights``.

    Example:
        >>> from lorasync.errors import EngineUnavailableError
        >>> engine = MemoryEngine(max_loras=2)
        >>> engine.fail_next("load_adapter", EngineUnavailableError("down"))
        >>> engine.list_adapters()
        []
    """

    kind = "memory"

    def __init__(
        self,
        url: str = "memory://",
        *,
        max_loras: int | None = None,
        max_rank: int | None = None,
        tensor_load: bool = True,
        weight_update: bool = True,
    ) -> None:
        self.url = url
        self._max_loras = max_loras
        self._max_rank = max_rank
        self._tensor_load = tensor_load
        self._weight_update = weight_update
        self._adapters: dict[str, Adapter] = {}
        self._paths: dict[str, str | None] = {}
        self._sources: dict[str, str] = {}  # served name -> the path it was read from, or a token per tensor load
        self._failures: dict[str, list[BaseException]] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.ops: list[str] = []
        self._lock = threading.RLock()
        self._requests = InFlight()

    # -- test controls -------------------------------------------------------------------------

    @contextlib.contextmanager
    def request(self, name: str) -> Iterator[Adapter]:
        """Simulate a request running on adapter ``name`` for the ``with`` block (it shows in
        :meth:`adapters_in_use`); yields the adapter it runs on.

        Raises:
            AdapterNotFoundError: ``name`` is not loaded.
        """
        with self._lock:
            if name not in self._adapters:
                raise AdapterNotFoundError(f"adapter {name!r} is not loaded; loaded: {sorted(self._adapters)}", engine=self.kind, adapter=name)
            adapter = self._adapters[name]
        with self._requests.track(name):
            yield adapter

    def fail_next(self, op: str, error: BaseException, *, times: int = 1) -> None:
        """Make the next ``times`` calls of ``op`` (e.g. ``"load_adapter"``) raise ``error``
        before doing anything."""
        with self._lock:
            self._failures.setdefault(op, []).extend([error] * times)

    @property
    def adapters(self) -> Mapping[str, Adapter]:
        """Read-only view of the loaded adapters by name."""
        with self._lock:
            return MappingProxyType(dict(self._adapters))

    def path_of(self, name: str) -> str | None:
        """The directory ``name`` was loaded from (None for a tensor load)."""
        with self._lock:
            return self._paths[name]

    # -- the Engine protocol -----------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        self._enter("capabilities")
        return self._caps()

    def _caps(self) -> Capabilities:
        return Capabilities(
            engine=self.kind,
            url=self.url,
            max_rank=self._max_rank,
            max_loras=self._max_loras,
            tensor_load=self._tensor_load,
            weight_update=self._weight_update,
        )

    def load_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        """Read ``path`` with ``Adapter.load`` and serve it as ``name``.

        Raises:
            AdapterAlreadyLoadedError, AdapterNotFoundError (no adapter_config.json),
            AdapterRejectedError (unreadable or invalid), RankTooLargeError, CapacityError.
        """
        with self._lock:
            self._enter("load_adapter")
            self._check_new(name)
            directory = Path(path)
            if not (directory / ADAPTER_CONFIG).is_file():
                raise AdapterNotFoundError(
                    f"no PEFT adapter at {directory} (no {ADAPTER_CONFIG})", engine=self.kind, adapter=name
                )
            try:
                adapter = Adapter.load(directory)
            except (LoraSyncError, OSError, ValueError, KeyError, TypeError) as exc:  # bad files or config
                raise AdapterRejectedError(
                    f"cannot load adapter {name!r} from {directory}: {exc}", engine=self.kind, adapter=name
                ) from exc
            self._admit(name, adapter, str(directory))

    def load_adapter_tensors(self, name: str, adapter: Adapter) -> None:
        with self._lock:
            self._enter("load_adapter_tensors")
            if not self._tensor_load:
                super().load_adapter_tensors(name, adapter)
            self._check_new(name)
            self._admit(name, adapter, None)

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            self._enter("unload_adapter")
            if name not in self._adapters:
                raise AdapterNotFoundError(
                    f"adapter {name!r} is not loaded; loaded: {sorted(self._adapters)}", engine=self.kind, adapter=name
                )
            del self._adapters[name]
            del self._paths[name]
            del self._sources[name]

    def list_adapters(self) -> list[str]:
        with self._lock:
            self._enter("list_adapters")
            return list(self._adapters)

    def adapter_sources(self) -> dict[str, str]:
        """Where each adapter came from: its directory, or a token unique to its tensor load.
        A listing too: it is recorded as ``list_adapters`` (and fails as ``fail_next`` says)."""
        with self._lock:
            self._enter("list_adapters")
            return dict(self._sources)

    def adapters_in_use(self) -> frozenset[str]:
        """Names with a :meth:`request` running (exact: this engine sees every request)."""
        return self._requests.names()

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        with self._lock:
            self._enter("update_weights")
            if not self._weight_update:
                super().update_weights(named_tensors)
            self.weights.update({k: v.detach().clone() for k, v in named_tensors.items()})

    # -- internals ------------------------------------------------------------------------------

    def _enter(self, op: str) -> None:
        with self._lock:
            self.ops.append(op)
            pending = self._failures.get(op)
            if pending:
                raise pending.pop(0)

    def _check_new(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidNameError(f"adapter name must be a non-empty string, got {name!r}")
        if name in self._adapters:
            raise AdapterAlreadyLoadedError(f"adapter {name!r} is already loaded", engine=self.kind, adapter=name)

    def _admit(self, name: str, adapter: Adapter, path: str | None) -> None:
        self._caps().check(adapter)
        if self._max_loras is not None and len(self._adapters) >= self._max_loras:
            raise CapacityError(
                f"{self._max_loras} adapters loaded already (max_loras); unload one of {sorted(self._adapters)}",
                engine=self.kind,
                adapter=name,
            )
        self._adapters[name] = adapter
        self._paths[name] = path
        self._sources[name] = os.path.abspath(path) if path is not None else f"tensors:{uuid.uuid4().hex}"
