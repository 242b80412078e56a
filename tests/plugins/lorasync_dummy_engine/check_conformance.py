"""The plugin's own conformance test, as a plugin author would write it.

Not collected by lorasync's suite (the name does not start with ``test_``):
tests/engines/test_registry.py runs it with pytest after installing this package.
"""

from __future__ import annotations

import pytest

from lorasync.engines import Engine, connect
from lorasync.testing import EngineConformance


class TestDummyEngineConformance(EngineConformance):
    @pytest.fixture
    def engine(self) -> Engine:
        return connect("dummy", "dummy://conformance")
