"""Old name of :mod:`lorasync.transports._transport` (``Transport`` and ``Delivery``): in lorasync
"base" means base weights only. Kept until ``_handle.py`` and ``transports/disk.py`` import
``_transport`` (they are being changed on another branch); then delete it."""

from lorasync.transports._transport import Delivery, Transport

__all__ = ["Delivery", "Transport"]
