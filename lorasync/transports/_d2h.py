"""Old import path of :mod:`lorasync.wire.d2h` and the layout verbs, kept only so branches
written against it keep importing until they are merged; new code imports ``lorasync.wire``."""

from __future__ import annotations

from typing import Any

from lorasync.wire.d2h import DEFAULT_CHUNK_BYTES, HostBuffer, gather_into, serialize, to_shm_segment
from lorasync.wire.layout import Layout
from lorasync.wire.layout import plan as layout
from lorasync.wire.views import ViewPlan, apply_views, plan_views, views

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "HostBuffer",
    "Layout",
    "ViewPlan",
    "apply_views",
    "gather_into",
    "layout",
    "plan_views",
    "serialize",
    "to_host",
    "to_shm_segment",
    "views",
]


def to_host(adapter: Any, **options: Any) -> Any:
    """``adapter.to_host(**options)`` (see :meth:`lorasync.Adapter.to_host`)."""
    return adapter.to_host(**options)
