"""A count of requests per adapter name, for engines that see every request themselves (the
in-process PEFT engine, the test fakes): their exact answer to ``Engine.adapters_in_use``."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["InFlight"]


class InFlight:
    """Thread-safe counts of running or waiting requests per adapter name."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._guard = threading.Lock()

    @contextlib.contextmanager
    def track(self, name: str | None) -> Iterator[None]:
        """Count one request on ``name`` for the ``with`` block (None: the base model, not counted)."""
        if name is None:
            yield
            return
        with self._guard:
            self._counts[name] = self._counts.get(name, 0) + 1
        try:
            yield
        finally:
            with self._guard:
                left = self._counts[name] - 1
                if left:
                    self._counts[name] = left
                else:
                    del self._counts[name]

    def names(self) -> frozenset[str]:
        """Names with at least one request now."""
        with self._guard:
            return frozenset(self._counts)
