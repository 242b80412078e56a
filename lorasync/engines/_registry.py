"""The engine registry: name -> engine class, with lazy ``"module:Class"`` targets and
entry-point discovery, and ``connect`` / ``parse_engine_spec`` on top of it.

Built-in engines are declared in lorasync's own ``pyproject.toml`` under the entry-point group
``lorasync.engines``, exactly like third-party plugins, so there is one way in. Duplicate rule:
registering the same target again is a no-op; a different target raises
``DuplicateRegistrationError`` unless ``clobber=True``. During discovery a plugin that fails
(bad target, clash with an earlier entry) is logged and skipped, never fatal.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from collections.abc import Mapping
from importlib import metadata
from types import MappingProxyType
from typing import Any

from lorasync.engines._engine import Engine
from lorasync.engines._group import EngineGroup
from lorasync.errors import ConfigError, DuplicateRegistrationError, RegistryError, UnknownEngineError

__all__ = [
    "engine_list",
    "BUILTIN_ENGINES",
    "ENGINE_GROUP",
    "Registry",
    "available_engines",
    "connect",
    "engine_registry",
    "parse_engine_spec",
    "register_engine",
]

logger = logging.getLogger("lorasync")

ENGINE_GROUP = "lorasync.engines"


class Registry:
    """Name → class, where a class may be given lazily as ``"package.module:Class"``.

    Args:
        group (`str`, *optional*): entry-point group discovered once, on first lookup.
        what (`str`): what the entries are, for messages (``"engine"``).
    """

    def __init__(self, group: str | None = None, *, what: str = "engine") -> None:
        self._group = group
        self._what = what
        self._targets: dict[str, str | type] = {}
        self._loaded: dict[str, type] = {}
        self._discovered = group is None
        self._lock = threading.Lock()
        self._discover_lock = threading.Lock()

    def register(self, name: str, target: str | type, *, clobber: bool = False) -> None:
        """Register ``target`` (a class or ``"module:Class"``) under ``name``.

        Raises:
            DuplicateRegistrationError: ``name`` is taken by a different target and
                ``clobber`` is false.
        """
        if not name or not isinstance(name, str):
            raise RegistryError(f"{self._what} name must be a non-empty string, got {name!r}")
        if isinstance(target, str) and ":" not in target:
            raise RegistryError(f"lazy target for {name!r} must look like 'package.module:Class', got {target!r}")
        if isinstance(target, str):
            target = MOVED_TARGETS.get(target, target)
        with self._lock:
            current = self._targets.get(name)
            if current is not None and not clobber and not _same(current, target):
                raise DuplicateRegistrationError(
                    f"{self._what} {name!r} is already registered as {_describe(current)}; "
                    f"pass clobber=True to replace it with {_describe(target)}",
                    name=name,
                )
            self._targets[name] = target
            self._loaded.pop(name, None)

    def get(self, name: str) -> type:
        """The class registered under ``name``, importing it on first use.

        Raises:
            UnknownEngineError: nothing is registered under ``name``.
            RegistryError: the target cannot be imported (the message says what to install).
        """
        self.discover()
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
            target = self._targets.get(name)
        if target is None:
            raise UnknownEngineError(
                f"no {self._what} named {name!r}; available: {sorted(self._targets)}. Install the plugin "
                "that provides it (it registers under the 'lorasync.engines' entry-point group), or "
                "call register_engine()",
                name=name,
            )
        cls = _load(target) if isinstance(target, str) else target
        with self._lock:
            self._loaded[name] = cls
        return cls

    def available(self) -> Mapping[str, str | type]:
        """Read-only view of every registered name and its target (discovery included)."""
        self.discover()
        return MappingProxyType(dict(self._targets))

    def discover(self) -> None:
        """Read the entry-point group once per registry. Loading must be idempotent."""
        if self._discovered:
            return
        # Concurrent first lookups (engines driven in parallel) wait until every entry point
        # is registered instead of seeing a half-filled registry.
        with self._discover_lock:
            if self._discovered or self._group is None:
                return
            eps = sorted(metadata.entry_points(group=self._group), key=_builtin_first)
            for ep in eps:
                try:
                    self.register(ep.name, ep.value)
                except Exception:  # a broken plugin must never break lorasync
                    logger.exception("skipping %s plugin %r from %r", self._group, ep.name, ep.value)
            self._discovered = True


def _builtin_first(ep: metadata.EntryPoint) -> tuple[int, str]:
    return (0 if ep.value.startswith("lorasync.") else 1, ep.name)


def _same(a: str | type, b: str | type) -> bool:
    if _describe(a) == _describe(b):
        return True
    # A class and a lazy target naming it through a package's re-export
    # ("lorasync.engines.peft:PeftEngine" for a class defined in lorasync.engines.peft.engine).
    cls, target = (a, b) if isinstance(a, type) else (b, a)
    if not (isinstance(cls, type) and isinstance(target, str)):
        return False
    module = sys.modules.get(target.partition(":")[0])  # only what is imported already: stay lazy
    return module is not None and getattr(module, target.partition(":")[2], None) is cls


def _describe(target: str | type) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def _load(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise RegistryError(
            f"cannot import {target!r}: {exc}. Install the package that provides it.", target=target
        ) from exc
    return obj


# Built-in targets that moved, old -> new. The old module still re-exports the class, so both
# name the same one: metadata written before the move (an editable install not reinstalled since)
# or a plugin registering the old target counts as the new target and never clashes with it.
MOVED_TARGETS = {
    "lorasync.engines.peft_local:PeftEngine": "lorasync.engines.peft:PeftEngine",
}

engine_registry = Registry(ENGINE_GROUP, what="engine")

# The built-ins, registered here too (same targets as pyproject's entry points, so discovery
# adds nothing twice): a checkout that is only on PYTHONPATH, as in an engine's own venv, has no
# installed distribution and thus no entry points.
BUILTIN_ENGINES = {
    "vllm": "lorasync.engines.vllm:VLLMEngine",
    "vllm-inprocess": "lorasync.engines.vllm.inprocess:VLLMInProcessEngine",
    "vllm-pull": "lorasync.engines.vllm.pull:VLLMPullEngine",
    "vllm-router": "lorasync.engines.vllm.router:VLLMRouter",
    "aibrix": "lorasync.engines.aibrix:AIBrixEngine",
    "sglang": "lorasync.engines.sglang:SGLangEngine",
    "peft": "lorasync.engines.peft:PeftEngine",
    "ray": "lorasync.engines.ray_actor:RayEngine",
}
for _name, _target in BUILTIN_ENGINES.items():
    engine_registry.register(_name, _target)


def register_engine(name: str, target: str | type, *, clobber: bool = False) -> None:
    """Register an engine class (or lazy ``"module:Class"``) under ``name`` in this process.

    Plugins normally declare an entry point in the ``lorasync.engines`` group instead.
    """
    engine_registry.register(name, target, clobber=clobber)


def available_engines() -> list[str]:
    """Names of every registered engine kind, built-ins and plugins."""
    return sorted(engine_registry.available())


def connect(kind: str, url: str = "", *, registry: Registry | None = None, **options: Any) -> Engine | EngineGroup:
    """A client for the engine kind ``kind`` at ``url``: an :class:`Engine`, or for a kind that
    names several engines behind one URL (``"vllm-router"``) an :class:`EngineGroup`, which every
    publisher takes as the engines it lists.

    Args:
        kind (`str`): ``"vllm"``, ``"vllm-inprocess"``, ``"sglang"``, ``"peft"``, ``"ray"`` or a
            plugin's name.
        url (`str`): the server's URL (engines that run in-process ignore it).
        registry (`Registry`, *optional*): look ``kind`` up here instead of the global registry.
        **options: passed to the client's constructor (``api_key``, ``timeout``, ``retries``...).

    Returns:
        `Engine | EngineGroup`: a client with sync methods and ``a``-prefixed async twins, or a group.

    Raises:
        UnknownEngineError: no engine named ``kind``.

    Example:
        >>> engine = connect("vllm", "http://127.0.0.1:8000")  # doctest: +SKIP
        >>> engine.load_adapter("policy@v3", "/dev/shm/lorasync/policy/v3")  # doctest: +SKIP
    """
    cls = (registry or engine_registry).get(kind)
    if not (isinstance(cls, type) and issubclass(cls, (Engine, EngineGroup))):
        raise ConfigError(f"engine {kind!r} resolves to {cls!r}, which is not a lorasync Engine (or EngineGroup) subclass")
    return cls(url, **options) if url else cls(**options)


def parse_engine_spec(spec: str | Engine | EngineGroup, *, registry: Registry | None = None) -> Engine | EngineGroup:
    """``"vllm:http://127.0.0.1:8000"`` → connected client; an Engine (or EngineGroup) passes through.

    Raises:
        ConfigError: ``spec`` is neither an Engine nor a spec string.
    """
    if isinstance(spec, (Engine, EngineGroup)):
        return spec
    if not isinstance(spec, str):
        raise ConfigError(f"an engine must be a lorasync Engine (lorasync.engines.connect(...)) or a spec like 'vllm:http://127.0.0.1:8000', got {type(spec).__name__}")
    kind, sep, url = spec.partition(":")
    if not kind:
        raise ConfigError(f"engine spec {spec!r} must look like 'vllm:http://host:port' or 'peft'")
    return connect(kind, url if sep else "", registry=registry)


def engine_list(engines: object, *, what: str, made: list[Engine] | None = None) -> list[Engine]:
    """The engines a publisher or fleet was given (one, or an iterable of engines and specs),
    each checked before any is connected. ``made`` (optional) receives the clients built here
    from spec strings: the caller's own, to close with it.

    An :class:`EngineGroup` (``"vllm-router:URL"``) stands for the engines it lists now, each
    one of the list.

    Raises:
        ConfigError: not an engine, a spec or an iterable of them, or none at all.
        EngineError: a group could not list its engines (its message says what to do).
    """
    if isinstance(engines, (Engine, EngineGroup, str)):
        engines = [engines]
    if engines is None or isinstance(engines, (bytes, dict)) or not hasattr(engines, "__iter__"):
        raise ConfigError(f"{what} needs engines: an Engine, a spec like 'vllm:http://127.0.0.1:8000', or a list of them; got {type(engines).__name__}")
    listed = list(engines)  # type: ignore[call-overload]
    for spec in listed:
        if not isinstance(spec, (Engine, EngineGroup, str)):
            raise ConfigError(f"{what}: an engine must be a lorasync Engine (lorasync.engines.connect(...)) or a spec like 'vllm:http://127.0.0.1:8000', got {type(spec).__name__}")
    if not listed:
        raise ConfigError(f"{what} needs at least one engine")
    out: list[Engine] = []
    mine: list[Engine] = []  # clients made here: closed again if a later one fails
    try:
        for spec in listed:
            engine = parse_engine_spec(spec)
            if isinstance(engine, EngineGroup):
                # Several engines behind one URL: each is published to as an engine of its own
                # (lorasync.engines._group). Their clients are made here: the caller's to close.
                try:
                    members = engine.members()
                finally:
                    if isinstance(spec, str):
                        engine.close()
                mine += members
                out += members
                continue
            if isinstance(spec, str):
                mine.append(engine)
            out.append(engine)
    except BaseException:
        for engine in mine:
            engine.close()
        raise
    if made is not None:
        made.extend(mine)
    return out
