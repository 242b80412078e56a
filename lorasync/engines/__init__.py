"""Engine clients: one small protocol (``Engine``), built-ins for vLLM, SGLang and an
in-process PEFT engine, and a registry that plugins join through the ``lorasync.engines``
entry-point group.

May import: errors, wire, runtime, adapter, ``lorasync.transforms``; never transports, the
publisher, the fleet or anything above them (transports use the engine protocol, not the reverse).
"""

from lorasync.engines._engine import Capabilities, Engine
from lorasync.engines._group import EngineGroup
from lorasync.engines._registry import (
    ENGINE_GROUP,
    available_engines,
    connect,
    engine_registry,
    parse_engine_spec,
    register_engine,
)

__all__ = [
    "ENGINE_GROUP",
    "Capabilities",
    "Engine",
    "EngineGroup",
    "available_engines",
    "connect",
    "engine_registry",
    "parse_engine_spec",
    "register_engine",
]
