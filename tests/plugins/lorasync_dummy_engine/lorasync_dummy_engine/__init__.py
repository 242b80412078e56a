"""A dummy lorasync engine plugin: an in-memory engine registered as ``dummy``.

A real plugin would talk to its server here; this one reuses ``lorasync.testing.MemoryEngine``
so lorasync's tests can prove that discovery, ``connect`` and the conformance suite work for
a package lorasync knows nothing about.
"""

from __future__ import annotations

from typing import Any

from lorasync.testing import MemoryEngine

__all__ = ["DummyEngine"]


class DummyEngine(MemoryEngine):
    """``connect("dummy", url, **options)`` builds this: an in-memory engine named ``dummy``."""

    kind = "dummy"

    def __init__(self, url: str = "dummy://", **options: Any) -> None:
        super().__init__(url, **options)
