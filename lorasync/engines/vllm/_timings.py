"""Where a worker's loads of staged adapters spend their time (the GPU benchmark reads it).

Each load of an adapter lorasync staged is recorded as ``{"name", "stage_s", "build_s", "add_s"}``:
the stage file read and the tensors mapped or copied; vLLM's ``LoRAModel`` built from them and
checked; and the whole of the worker's add (``WorkerLoRAManager.add_adapter``: the load, vLLM's
registration, the LRU's eviction and the activation, which is lorasync's slot write). What the
client's load takes above ``add_s`` is the request's way through the API server and the engine
core. Kept in the worker process, the last 64 loads.

Where the add's own time goes, for the benchmark: with ``LORASYNC_PROFILE_ADDS=N:PATH`` in the
engine's environment, the worker runs its first ``N`` timed adds under ``cProfile`` and then
writes their summary (by cumulative and by own time) to ``PATH.<pid>.txt``. Off by default;
the benchmark profiles only warm-up rounds, whose times it does not report.

Ground floor: imports only the standard library; it runs inside engine processes.
"""

from __future__ import annotations

import collections
import cProfile
import io
import os
import pstats
import threading
import time
import types
from typing import Any

__all__ = ["load_timings", "record_build", "time_adds"]

_TIMES: collections.deque[dict[str, Any]] = collections.deque(maxlen=64)
_LOCK = threading.Lock()


def load_timings() -> list[dict[str, Any]]:
    """This process's last loads of staged adapters, oldest first."""
    with _LOCK:
        return [dict(t) for t in _TIMES]


def record_build(name: str, stage_s: float, build_s: float) -> None:
    """Record one load of a staged adapter (its ``add_s`` is filled in when the add returns)."""
    with _LOCK:
        _TIMES.append({"name": name, "stage_s": stage_s, "build_s": build_s, "add_s": None})


def time_adds(manager: Any, prefix: str) -> None:
    """Time ``manager.add_adapter`` (vLLM's ``WorkerLoRAManager``) for requests whose path starts
    with ``prefix``: the add's seconds go to the last load recorded under that name."""
    if getattr(manager, "_lorasync_timed", False) or not callable(getattr(manager, "add_adapter", None)):
        return
    original = manager.add_adapter

    def add_adapter(self: Any, request: Any) -> Any:
        ours = str(getattr(request, "lora_path", "")).startswith(prefix)
        profile = _profiler() if ours else None
        start = time.perf_counter()
        try:
            if profile is None:
                return original(request)
            return profile.runcall(original, request)
        finally:
            if ours:
                _note_add(str(request.lora_name), time.perf_counter() - start)
            if profile is not None:
                _profiled(profile)

    manager.add_adapter = types.MethodType(add_adapter, manager)
    manager._lorasync_timed = True


def _note_add(name: str, add_s: float) -> None:
    with _LOCK:
        for entry in reversed(_TIMES):
            if entry["name"] == name:
                if entry["add_s"] is None:
                    entry["add_s"] = add_s
                return


_PROFILE: dict[str, Any] = {"left": None, "profile": None, "path": None}


def _profiler() -> cProfile.Profile | None:
    """The profile of the next add while ``LORASYNC_PROFILE_ADDS`` asks for more (module docstring)."""
    with _LOCK:
        if _PROFILE["left"] is None:
            count, _, path = os.environ.get("LORASYNC_PROFILE_ADDS", "").partition(":")
            _PROFILE.update(left=int(count) if count.isdigit() and path else 0, path=path, profile=cProfile.Profile())
        return _PROFILE["profile"] if _PROFILE["left"] > 0 else None


def _profiled(profile: cProfile.Profile) -> None:
    with _LOCK:
        _PROFILE["left"] -= 1
        if _PROFILE["left"] > 0:
            return
    text = io.StringIO()
    for order in ("cumulative", "tottime"):
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(45)
    with open(f"{_PROFILE['path']}.{os.getpid()}.txt", "w") as f:
        f.write(text.getvalue())
