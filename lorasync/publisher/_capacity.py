"""Which versions may leave an engine with a hard adapter limit so that one more can load, or
why none may: the capacity decision, pure (no engine calls), for :meth:`EngineHandle.make_room`.

Only versions that leave the retention window anyway and have no requests may go early; if that
is not enough the publish is refused, before anything is unloaded, with a :class:`CapacityError`
that says what the user can change.
"""

from __future__ import annotations

from collections.abc import Collection

from lorasync.adapter._names import parse_served_name, served_name
from lorasync.publisher._retention import Ledger, Retention
from lorasync.engines._engine import Capabilities
from lorasync.errors import CapacityError

__all__ = ["plan_room"]


def plan_room(
    name: str,
    ledger: Ledger,
    policy: Retention,
    pins: frozenset[int],
    caps: Capabilities,
    *,
    loaded: list[str],
    busy: frozenset[str] | None,
    kept: Collection[str],
    where: str,
    planned: bool = False,
) -> list[int]:
    """The versions of ``name`` to unload before one more version loads.

    Args:
        loaded: every adapter the engine holds now (other publishers' too, and retired ones it kept).
        busy: names with requests (None: the engine cannot tell; its unload then drains).
        kept: retired names the engine still holds although it answered their unload (slot leaks).
        where: the engine, as messages name it.
        planned: a :class:`~lorasync.Fleet` planned this engine's budget across its tenants before
            the round: only as many go as the load needs, so a previous version that has a slot
            keeps serving until its successor does (and if the successor fails).

    Raises:
        CapacityError: no room without unloading a version still needed; nothing was changed.
    """
    assert caps.max_loras is not None
    # After the new version loads, the window moves: versions it pushes out go now, before the
    # load, so concurrent publishers of several names never overrun the engine together.
    future = dict.fromkeys(ledger.versions) | {max(ledger.versions, default=-1) + 1: None}
    window = policy.window(list(future), pins)
    early = [v for v in sorted(ledger.versions) if v not in window and (busy is None or served_name(name, v) not in busy)]
    if busy is None or planned:
        # Requests unknown (SGLang, whose unload then waits for them): only as many as the load
        # needs, so an engine with room never waits on a draining unload before it loads.
        early = early[: max(0, len(loaded) + 1 - caps.max_loras)]
    elif len(loaded) - len(early) + 1 > caps.max_loras:
        early = []  # not enough room even so: refuse below, before unloading anything
    # An engine that kept adapters it answered the unload of may keep these too: no slot is
    # counted on from an unload, so the previous version is never taken down for nothing.
    freed = 0 if kept else len(early)
    if len(loaded) - freed + 1 > caps.max_loras:
        others = sorted(n for n in loaded if (parse_served_name(n) or ("", 0))[0] != name)
        advice = []
        if caps.max_loras <= policy.keep:
            advice.append(f"restart the engine with more adapter slots than keep={policy.keep} (vLLM --max-cpu-loras, SGLang --max-loaded-loras)")
        else:
            advice.append(f"lower keep= (now {policy.keep}) or restart the engine with more slots (SGLang --max-loaded-loras)")
        if caps.load_inplace:
            advice.append("publish in place (in_place=True), which needs no second slot")
        advice.append("or publish with transport='merged' (base=...), which needs no slot")
        raise CapacityError(
            f"{where} holds {len(loaded)} adapters ({', '.join(sorted(loaded)[:8])}) and can hold {caps.max_loras}; "
            f"none of them may go without taking one out from under a request or the retention window"
            + (f" (other adapters: {', '.join(others[:4])})" if others else "")
            + (
                f"; it still holds {', '.join(sorted(kept))} although it answered their unload "
                "(SlotLeakWarning), so unloading frees no slot there"
                if kept
                else ""
            )
            + "; nothing was unloaded. To publish: " + "; ".join(advice),
            engine=caps.engine,
            url=caps.url,
            capacity=caps.max_loras,
        )
    return early
