"""lorasync: push freshly trained LoRA adapters into running inference engines.

The top-level API is small on purpose: :class:`Adapter` (the canonical adapter), the exporters
(:mod:`lorasync.exporters`), engine clients (:mod:`lorasync.engines`), ``publish_adapter`` and
:class:`Publisher`. Every error is a :class:`lorasync.errors.LoraSyncError`.
"""

from lorasync._adapter import Adapter
from lorasync._config import AdapterConfig
from lorasync._probe import Probe
from lorasync._api import apublish_adapter, publish_adapter
from lorasync._publish import Publisher
from lorasync._report import EngineResult, PublishReport
from lorasync._retention import Retention, RetentionWarning
from lorasync._retry import RetryPolicy
from lorasync.errors import LoraSyncError
from lorasync.transports import BaseWeights

__version__ = "0.1.0"

__all__ = [
    "Adapter",
    "AdapterConfig",
    "BaseWeights",
    "EngineResult",
    "LoraSyncError",
    "Probe",
    "PublishReport",
    "Publisher",
    "Retention",
    "RetentionWarning",
    "RetryPolicy",
    "__version__",
    "apublish_adapter",
    "publish_adapter",
]
