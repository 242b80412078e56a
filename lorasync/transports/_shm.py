"""Old import path of :mod:`lorasync.wire.shm` (and the layout reader), kept only so branches
written against it keep importing until they are merged; new code imports ``lorasync.wire``."""

from __future__ import annotations

from lorasync.wire.views import read as parse_layout
from lorasync.wire.shm import ShmSegment, read_segment, write_segment

__all__ = ["ShmSegment", "parse_layout", "read_segment", "write_segment"]
