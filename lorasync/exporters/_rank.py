"""Compatibility shim: the rank transforms live in :mod:`lorasync.transforms`.

Kept because ``exporters/_megatron_convert.py`` imports ``trim_tensor`` from here; once it
imports from ``lorasync.transforms``, delete this module.
"""

from lorasync.transforms import normalize_scaling, trim_rank, trim_tensor

__all__ = ["normalize_scaling", "trim_rank", "trim_tensor"]
