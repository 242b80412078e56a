"""Where a worker's loads of staged adapters spend their time (the GPU benchmark reads it).

Each load of an adapter lorasync staged is recorded as ``{"name", "stage_s", "build_s", "add_s",
"templated"}``:
the stage file read and the tensors mapped or copied; vLLM's ``LoRAModel`` built from them and
checked; and the whole of the worker's add (``WorkerLoRAManager.add_adapter``: the load, vLLM's
registration, the LRU's eviction and the activation, which is lorasync's slot write). What the
client's load takes above ``add_s`` is the request's way through the API server and the engine
core. Kept in the worker process, the last 64 loads.

Where the add's own time goes, for the benchmark: with ``LORASYNC_PROFILE_ADDS=N:PATH`` in the
engine's environment, the worker runs its first ``N`` timed adds under ``cProfile`` and then
writes their summary (by cumulative and by own time) to ``PATH.<pid>.txt``. Off by default;
the benchmark profiles only warm-up rounds, whose times it does not report. A diagnostic only: a
value it cannot read, a profiler that cannot start or a summary that cannot be written is logged
once and never fails an add.

Ground floor: imports only the standard library; it runs inside engine processes.
"""

from __future__ import annotations

import collections
import cProfile
import io
import logging
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


def record_build(name: str, stage_s: float, build_s: float, *, templated: bool = False) -> None:
    """Record one load of a staged adapter (its ``add_s`` is filled in when the add returns);
    ``templated``: built from a layout built before (``_template``), not by vLLM's parse."""
    with _LOCK:
        _TIMES.append({"name": name, "stage_s": stage_s, "build_s": build_s, "add_s": None, "templated": templated})


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
            return original(request)
        finally:
            if profile is not None:
                profile.disable()
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
_log = logging.getLogger(__name__)


def _profiler() -> cProfile.Profile | None:
    """The profile, enabled, for the next add while ``LORASYNC_PROFILE_ADDS`` asks for more
    (module docstring). Never raises: a value it cannot read, or a profiler that cannot start
    (another one is active, an audit hook refuses it), means no profile; the add runs as always."""
    try:
        with _LOCK:
            if _PROFILE["left"] is None:
                _PROFILE.update(left=0)  # until the value is read: a value that cannot be read is no profile
                count, _, path = os.environ.get("LORASYNC_PROFILE_ADDS", "").partition(":")
                left = int(count) if count.isascii() and count.isdigit() and len(count) < 10 and path else 0
                _PROFILE.update(left=left, path=path, profile=cProfile.Profile() if left else None)
            profile = _PROFILE["profile"] if _PROFILE["left"] > 0 else None
        if profile is not None:
            profile.enable()
        return profile
    except Exception as exc:  # noqa: BLE001 - a diagnostic must never fail the engine's add
        _stop(f"cannot profile the worker's adds: {exc!r}")
        return None


def _profiled(profile: cProfile.Profile) -> None:
    """Count one profiled add; after the last one, write the summary (never raises: a summary
    that cannot be written is logged, and profiling stops)."""
    with _LOCK:
        _PROFILE["left"] -= 1
        if _PROFILE["left"] > 0:
            return
    try:
        text = io.StringIO()
        for order in ("cumulative", "tottime"):
            pstats.Stats(profile, stream=text).sort_stats(order).print_stats(45)
        with open(f"{_PROFILE['path']}.{os.getpid()}.txt", "w") as f:
            f.write(text.getvalue())
    except Exception as exc:  # noqa: BLE001 - a diagnostic must never fail the engine's add
        _stop(f"cannot write the profile of the worker's adds: {exc!r}")


def _stop(why: str) -> None:
    with _LOCK:
        _PROFILE["left"] = 0
    _log.warning("lorasync: %s; LORASYNC_PROFILE_ADDS is ignored from now on", why)
