"""lorasync: push freshly trained LoRA adapters into running inference engines.

The top-level API is small on purpose: :class:`Adapter` (the canonical adapter), the exporters
(:mod:`lorasync.exporters`), engine clients (:mod:`lorasync.engines`), ``publish_adapter`` and
:class:`Publisher`. Every error is a :class:`lorasync.errors.LoraSyncError`.

The names load on first use (PEP 562 ``__getattr__``): ``import lorasync`` and ``lorasync
--help`` import neither torch nor httpx, which take seconds on a busy machine.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from lorasync.adapter._adapter import Adapter
    from lorasync.publisher._api import apublish_adapter, publish_adapter
    from lorasync.adapter._config import AdapterConfig
    from lorasync.fleet._fleet import Fleet
    from lorasync.fleet._plan import FleetReport, TenantReport
    from lorasync.fleet._tenant import Tenant
    from lorasync.adapter._probe import Probe
    from lorasync.publisher._publisher import Publisher
    from lorasync.publisher._report import EngineResult, PublishReport
    from lorasync.publisher._retention import Retention, RetentionWarning
    from lorasync.runtime._retry import RetryPolicy
    from lorasync.errors import LoraSyncError
    from lorasync.transports import BaseWeights

__version__ = "0.1.0"

# public name -> module defining it
_LAZY = {
    "Adapter": "lorasync.adapter._adapter",
    "AdapterConfig": "lorasync.adapter._config",
    "BaseWeights": "lorasync.transports",
    "EngineResult": "lorasync.publisher._report",
    "Fleet": "lorasync.fleet._fleet",
    "FleetReport": "lorasync.fleet._plan",
    "LoraSyncError": "lorasync.errors",
    "Probe": "lorasync.adapter._probe",
    "PublishReport": "lorasync.publisher._report",
    "Publisher": "lorasync.publisher._publisher",
    "Retention": "lorasync.publisher._retention",
    "RetentionWarning": "lorasync.publisher._retention",
    "RetryPolicy": "lorasync.runtime._retry",
    "Tenant": "lorasync.fleet._tenant",
    "TenantReport": "lorasync.fleet._plan",
    "apublish_adapter": "lorasync.publisher._api",
    "publish_adapter": "lorasync.publisher._api",
}

__all__ = [
    "Adapter",
    "AdapterConfig",
    "BaseWeights",
    "EngineResult",
    "Fleet",
    "FleetReport",
    "LoraSyncError",
    "Probe",
    "PublishReport",
    "Publisher",
    "Retention",
    "RetentionWarning",
    "RetryPolicy",
    "Tenant",
    "TenantReport",
    "__version__",
    "apublish_adapter",
    "publish_adapter",
]


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lorasync' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
