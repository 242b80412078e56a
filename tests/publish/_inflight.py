"""A vLLM-like in-memory engine for retention tests: requests stay in flight under test control,
and every decoding step re-reads the adapter's files, as vLLM's worker does for an adapter it
evicted from its LRU. A step that finds its adapter unloaded or its files gone is recorded as a
violation (on vLLM: ``LoRAAdapterNotFoundError`` and a dead engine core)."""

from __future__ import annotations

import itertools
import os
from dataclasses import replace

from lorasync.engines import Capabilities
from lorasync.testing import MemoryEngine


class ReloadingEngine(MemoryEngine):
    kind = "reloading"

    def __init__(self, url: str = "reloading://", **kwargs) -> None:
        super().__init__(url, **kwargs)
        self._running: dict[int, tuple[str, str | None]] = {}  # request id -> (served name, path)
        self._ids = itertools.count(1)
        self.violations: list[str] = []
        self.steps = 0

    def _caps(self) -> Capabilities:
        return replace(super()._caps(), reloads_from_path=True)

    def start(self, name: str) -> int:
        """A request on ``name`` enters the engine (it keeps the adapter's path, like a LoRARequest)."""
        with self._lock:
            path = self.path_of(name)  # KeyError if not loaded: the test only starts on loaded names
            rid = next(self._ids)
            self._running[rid] = (name, path)
            return rid

    def step(self) -> None:
        """One decoding step for every running request."""
        with self._lock:
            self.steps += 1
            for rid, (name, path) in self._running.items():
                if name not in self.adapters:
                    self.violations.append(f"request {rid} on {name}: adapter unloaded while it ran")
                if path is not None and not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
                    self.violations.append(f"request {rid} on {name}: files {path} gone (vLLM's engine core would die)")

    def finish(self, rid: int) -> None:
        with self._lock:
            self._running.pop(rid, None)

    def restart(self) -> None:
        """The server restarts: every adapter and request is gone."""
        with self._lock:
            self._running.clear()
            for name in list(self.adapters):
                super().unload_adapter(name)

    @property
    def running(self) -> dict[int, str]:
        with self._lock:
            return {rid: name for rid, (name, _) in self._running.items()}

    def adapters_in_use(self) -> frozenset[str]:
        with self._lock:
            return frozenset(name for name, _ in self._running.values()) | super().adapters_in_use()
