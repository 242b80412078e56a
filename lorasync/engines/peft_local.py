"""Deprecated: the in-process PEFT engine now lives in :mod:`lorasync.engines.peft`, named like
its registry name. This module only re-exports :class:`PeftEngine` so that existing
``from lorasync.engines.peft_local import PeftEngine`` keeps working; import it from
``lorasync.engines.peft`` instead.
"""

import warnings

from lorasync.engines.peft import PeftEngine

__all__ = ["PeftEngine"]

warnings.warn(
    "lorasync.engines.peft_local is deprecated; import PeftEngine from lorasync.engines.peft",
    DeprecationWarning,
    stacklevel=2,
)
