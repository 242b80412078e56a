"""The fleet's shared slot budget (pure: no engine calls) and its reports.

On an engine with an adapter limit (``Capabilities.max_loras``) every tenant of a
:class:`~lorasync.Fleet` draws on one budget. :func:`plan_slots` decides, before a round touches
anything, which versions stay loaded, in this order:

1. every tenant's current version (the one it publishes now, or the one it serves);
2. versions that are pinned (leases) or have requests running or waiting;
3. the tenants' retention windows, newest first, one version per tenant at a time;
4. versions outside the windows (the publishers retire them once their successors serve).

What does not fit in tiers 3 and 4 goes before the round's loads; what fits stays, so a tenant's
previous version keeps serving while (and if) its successor fails to load. When tiers 1 and 2 do not fit, the
round is refused with a :class:`CapacityError` naming the tenants and slots, and nothing was
unloaded. On an engine that rebuilds an evicted adapter from its files (vLLM: its CPU cache is an
LRU over ``--max-cpu-loras``), the budget is soft for tier 2: pinned and in-use versions stay
loaded beyond it while they drain (refusing would stop every round while requests run), and
only tier 1 must fit. One tenant's window can therefore never push out another tenant's current or in-use
version: those are planned before any window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from lorasync.adapter._names import served_name
from lorasync.publisher._report import EngineResult, PublishReport
from lorasync.errors import CapacityError, LoraSyncError

__all__ = ["FleetReport", "SlotNeed", "TenantReport", "plan_slots"]


@dataclass(frozen=True)
class SlotNeed:
    """One tenant as one engine's budget sees it.

    Args:
        tenant (`str`): the tenant's name.
        current (`int | None`): the version that must be loaded after the round (None: none yet).
        loaded (`tuple[int, ...]`): its versions the engine lists now.
        held (`frozenset[int]`): its versions that are pinned or have requests.
        window (`frozenset[int]`): its versions its retention window keeps after the round.
        first (`bool`): registered, never published: a slot is booked for its first version
            (registration refuses what would not fit, so no later round finds it overbooked).
    """

    tenant: str
    current: int | None
    loaded: tuple[int, ...] = ()
    held: frozenset[int] = frozenset()
    window: frozenset[int] = frozenset()
    first: bool = False


def plan_slots(needs: Sequence[SlotNeed], *, capacity: int, foreign: Sequence[str], where: str, soft: bool = False, engine: str = "", url: str = "") -> list[tuple[str, int]]:
    """The ``(tenant, version)`` pairs to unload before the round so that everything fits.

    Args:
        needs: every tenant on the engine.
        capacity (`int`): the engine's adapter slots.
        foreign: adapters the engine holds that belong to no tenant (they are never touched).
        where (`str`): the engine, as messages name it.
        soft (`bool`): the engine reloads evicted adapters from their files: pinned and in-use
            versions may exceed ``capacity`` while they drain (only current versions must fit).

    Returns:
        Versions to unload (tiers 3 and 4 that do not fit), sorted.

    Raises:
        CapacityError: current and in-use versions alone exceed ``capacity``; nothing was unloaded.
    """
    must = {(n.tenant, n.current) for n in needs if n.current is not None}
    held = {(n.tenant, v) for n in needs for v in n.held if v in n.loaded} - must
    first = sorted(n.tenant for n in needs if n.current is None and n.first)
    required = len(foreign) + len(must) + len(first) + len(held)
    if (len(foreign) + len(must) + len(first) if soft else required) > capacity:
        current = ", ".join([served_name(t, v) + ("" if v in _loaded(needs, t) else " (to load)") for t, v in sorted(must)] + [f"{t} (its first version)" for t in first])
        busy = ", ".join(served_name(t, v) for t, v in sorted(held))
        raise CapacityError(
            f"{where} has {capacity} adapter slots, and the tenants need {required}: current versions {current or 'none'}"
            + (f"; pinned or with requests {busy}" if busy else "")
            + (f"; adapters of no tenant {', '.join(sorted(foreign)[:6])}" if foreign else "")
            + ". Nothing was unloaded. To fit: retire a tenant (fleet.retire(name)), let leases end, or restart "
            "the engine with more slots (vLLM --max-loras/--max-cpu-loras, SGLang --max-loaded-loras, PeftEngine max_loras=)",
            engine=engine,
            url=url,
            capacity=capacity,
            tenants=tuple(sorted({t for t, _ in must | held} | set(first))),
        )
    ranked = []
    for need in needs:
        extra = sorted((v for v in need.loaded if v in need.window and (need.tenant, v) not in must | held), reverse=True)
        ranked += [(0, rank, need.tenant, v) for rank, v in enumerate(extra)]
        # Outside the window, but free slots are no reason to unload before the round's loads: a
        # tenant's previous version serves until its successor does (its publisher retires it
        # after that), and keeps serving if the successor fails. Only what does not fit goes now.
        older = sorted((v for v in need.loaded if v not in need.window and (need.tenant, v) not in must | held), reverse=True)
        ranked += [(1, rank, need.tenant, v) for rank, v in enumerate(older)]
    ranked.sort()
    kept = {(t, v) for *_, t, v in ranked[: max(0, capacity - required)]}
    return sorted((n.tenant, v) for n in needs for v in n.loaded if (n.tenant, v) not in must | held | kept)


def _loaded(needs: Sequence[SlotNeed], tenant: str) -> tuple[int, ...]:
    return next((n.loaded for n in needs if n.tenant == tenant), ())


@dataclass
class TenantReport:
    """What one round did for one tenant.

    Attributes:
        name (`str`): the tenant's name.
        registration (`str`): the id of the registration it ran under (unique per ``register``).
        status (`str`): ``"loaded"`` (a new version was published), ``"unchanged"`` (same
            content as its current version: nothing sent, version kept), ``"restored"`` (its
            current version was loaded again on engines that lost it, version unchanged) or
            ``"failed"``.
        version (`int | None`): the version it serves after the round.
        served_name (`str`): what to put in ``model=``.
        publish (`PublishReport | None`): the publisher's report, one ``EngineResult`` per engine.
        error (`LoraSyncError | None`): why it failed (also when the failure came before any engine).
        restored_on (`list[str]`): engines (``kind at url``) its current version was loaded on again.
    """

    name: str
    registration: str
    status: Literal["loaded", "unchanged", "restored", "failed"]
    version: int | None = None
    served_name: str = ""
    publish: PublishReport | None = None
    error: LoraSyncError | None = None
    restored_on: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status != "failed"

    @property
    def results(self) -> list[EngineResult]:
        """One result per engine (empty when nothing was sent)."""
        return self.publish.results if self.publish is not None else []


@dataclass
class FleetReport:
    """One round of :meth:`Fleet.publish` or :meth:`Fleet.restore`: a report per tenant.

    Attributes:
        tenants (`dict[str, TenantReport]`): by tenant name; every tenant published, unchanged,
            restored or failed in the round.
        unloaded (`list[str]`): versions the capacity plan unloaded before the round's loads.
    """

    tenants: dict[str, TenantReport] = field(default_factory=dict)
    unloaded: list[str] = field(default_factory=list)

    def __getitem__(self, name: str) -> TenantReport:
        return self.tenants[name]

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.tenants.values())

    @property
    def restored(self) -> dict[str, TenantReport]:
        """Tenants whose current version was loaded again (an engine restarted or lost it)."""
        return {n: t for n, t in self.tenants.items() if t.restored_on}

    def raise_for_errors(self) -> None:
        """Raise the first failed tenant's error (typed), naming the tenant.

        Raises:
            LoraSyncError: the first failure.
        """
        for tenant in self.tenants.values():
            if tenant.error is not None:
                raise tenant.error
