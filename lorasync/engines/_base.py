"""Old name of :mod:`lorasync.engines._engine` (the ``Engine`` protocol and ``Capabilities``): in
lorasync "base" means base weights only. Kept until ``_publish.py``, ``_handle.py`` and
``transports/disk.py`` import ``_engine`` (they are being changed on another branch); then delete it."""

from lorasync.engines._engine import Capabilities, Engine

__all__ = ["Capabilities", "Engine"]
