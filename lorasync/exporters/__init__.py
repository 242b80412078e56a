"""Exporters: trainer LoRA state (FSDP/PEFT, Megatron) → :class:`lorasync.Adapter`.

Each exporter is a module with one ``export(...)`` function; ``trim_rank`` and
``normalize_scaling`` (from :mod:`lorasync.transforms`) are shared by all of them.

May import: errors, wire, runtime, adapter, ``lorasync.transforms``; never transports, engines or
anything above them.
"""

from lorasync.transforms import normalize_scaling, trim_rank, trim_tensor

__all__ = ["normalize_scaling", "trim_rank", "trim_tensor"]
