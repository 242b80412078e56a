"""The process-wide engine registry (entry-point group ``lorasync.engines``) and ``connect``."""

from __future__ import annotations

from typing import Any

from lorasync._registry import Registry
from lorasync.engines._base import Engine
from lorasync.errors import ConfigError

__all__ = ["BUILTIN_ENGINES", "ENGINE_GROUP", "available_engines", "connect", "engine_registry", "parse_engine_spec", "register_engine"]

ENGINE_GROUP = "lorasync.engines"

engine_registry = Registry(ENGINE_GROUP, what="engine")

# The built-ins, registered here too (same targets as pyproject's entry points, so discovery
# adds nothing twice): a checkout that is only on PYTHONPATH, as in an engine's own venv, has no
# installed distribution and thus no entry points.
BUILTIN_ENGINES = {
    "vllm": "lorasync.engines.vllm:VLLMEngine",
    "vllm-inprocess": "lorasync.engines.vllm.inprocess:VLLMInProcessEngine",
    "sglang": "lorasync.engines.sglang:SGLangEngine",
    "peft": "lorasync.engines.peft_local:PeftEngine",
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


def connect(kind: str, url: str = "", *, registry: Registry | None = None, **options: Any) -> Engine:
    """A client for the engine kind ``kind`` at ``url``.

    Args:
        kind (`str`): ``"vllm"``, ``"vllm-inprocess"``, ``"sglang"``, ``"peft"``, ``"ray"`` or a
            plugin's name.
        url (`str`): the server's base URL (engines that run in-process ignore it).
        registry (`Registry`, *optional*): look ``kind`` up here instead of the global registry.
        **options: passed to the client's constructor (``api_key``, ``timeout``, ``retries``...).

    Returns:
        `Engine`: a client with sync methods and ``a``-prefixed async twins.

    Raises:
        UnknownEngineError: no engine named ``kind``.

    Example:
        >>> engine = connect("vllm", "http://127.0.0.1:8000")  # doctest: +SKIP
        >>> engine.load_adapter("policy@v3", "/dev/shm/lorasync/policy/v3")  # doctest: +SKIP
    """
    cls = (registry or engine_registry).get(kind)
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise ConfigError(f"engine {kind!r} resolves to {cls!r}, which is not a lorasync Engine subclass")
    return cls(url, **options) if url else cls(**options)


def parse_engine_spec(spec: str | Engine, *, registry: Registry | None = None) -> Engine:
    """``"vllm:http://127.0.0.1:8000"`` → connected client; an Engine passes through."""
    if isinstance(spec, Engine):
        return spec
    kind, sep, url = spec.partition(":")
    if not kind:
        raise ConfigError(f"engine spec {spec!r} must look like 'vllm:http://host:port' or 'peft'")
    return connect(kind, url if sep else "", registry=registry)
