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
    from lorasync._adapter import Adapter
    from lorasync._api import apublish_adapter, publish_adapter
    from lorasync._config import AdapterConfig
    from lorasync._fleet import Fleet
    from lorasync._fleet_plan import FleetReport, TenantReport
    from lorasync._tenant import Tenant
    from lorasync._probe import Probe
    from lorasync._publish import Publisher
    from lorasync._report import EngineResult, PublishReport
    from lorasync._retention import Retention, RetentionWarning
    from lorasync._retry import RetryPolicy
    from lorasync.errors import LoraSyncError
    from lorasync.transports import BaseWeights

__version__ = "0.1.0"

# public name -> module defining it
_LAZY = {
    "Adapter": "lorasync._adapter",
    "AdapterConfig": "lorasync._config",
    "BaseWeights": "lorasync.transports",
    "EngineResult": "lorasync._report",
    "Fleet": "lorasync._fleet",
    "FleetReport": "lorasync._fleet_plan",
    "LoraSyncError": "lorasync.errors",
    "Probe": "lorasync._probe",
    "PublishReport": "lorasync._report",
    "Publisher": "lorasync._publish",
    "Retention": "lorasync._retention",
    "RetentionWarning": "lorasync._retention",
    "RetryPolicy": "lorasync._retry",
    "Tenant": "lorasync._tenant",
    "TenantReport": "lorasync._fleet_plan",
    "apublish_adapter": "lorasync._api",
    "publish_adapter": "lorasync._api",
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
