"""Retention: which versions each engine keeps, and when an old one may leave — the version ledger.

A publisher keeps, per engine, a :class:`Ledger`: the versions the engine serves (with their
content hashes), versions that left the retention window but still had requests (``deferred``),
and what it merged or swapped in place. :class:`Retention` is the policy as one value object;
:func:`plan` is the pure decision the publisher acts on, so the rules are testable without I/O.

The rules (design invariant 5: no version leaves an engine, and no file leaves the store, while a
request on it may still run or an engine may still reload it):

* The window is the ``keep`` newest loaded versions, every pinned version, and every version
  within ``max_staleness`` of the newest. Nothing in the window is ever unloaded.
* A version whose verification did not pass (``Ledger.unverified``) is in no window: it goes
  at the next retirement, requests or not (nothing may rightly use it).
* A version outside the window is unloaded only when the engine reports no running or waiting
  request on it (:meth:`lorasync.engines.Engine.adapters_in_use`). An engine that cannot tell is
  given ``grace`` seconds from the moment the version left the window.
* A version still in use is *deferred*: it stays loaded and is retried on the next publish, on
  :meth:`Publisher.collect` and on close. After ``drain_timeout`` seconds, or when more than
  ``max_deferred`` versions wait, the oldest is unloaded anyway with a :class:`RetentionWarning`
  — never an unbounded pile of loaded adapters. (Its files still stay until the engine stops
  reporting it, so a request the engine reloads it for keeps its weights.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lorasync.errors import ConfigError, LoraSyncWarning, StaleVersionError

__all__ = ["LEARN", "Ledger", "Plan", "Retention", "RetentionWarning", "plan"]


class RetentionWarning(LoraSyncWarning):
    """A version was unloaded while requests may still use it (drain timeout or bound hit)."""


@dataclass(frozen=True)
class Retention:
    """How many versions stay loaded, and how old ones drain.

    Args:
        keep (`int`, defaults to 2): newest versions each engine keeps loaded (at least 1).
        grace (`float`, defaults to 1.0): seconds an engine that cannot report in-flight requests
            keeps a version after it left the window; also how long a version's files outlive its
            unload on engines that reload adapters from their path (vLLM).
        drain_timeout (`float | None`, defaults to 600): seconds a version may stay deferred
            before it is unloaded anyway (with a warning); None waits for ever.
        max_deferred (`int`, defaults to 8): deferred versions per engine before the oldest is
            unloaded anyway (with a warning).
        max_staleness (`int | None`): versions within this distance of the newest are never
            retired (an off-policy window: ``max_staleness=4`` keeps v(N-4)..vN while vN is newest).
        background (`bool`, defaults to True): retire old versions and collect their files after
            ``publish`` returned, once the new version serves (the next publish, ``collect`` and
            ``close`` wait for it first; ``report.settled()`` waits for one publish's). False: the
            publish call does it before returning.
    """

    keep: int = 2
    grace: float = 1.0
    drain_timeout: float | None = 600.0
    max_deferred: int = 8
    max_staleness: int | None = None
    background: bool = True

    def __post_init__(self) -> None:
        # Every number a user can get wrong, refused here with the fix: a NaN grace retired a
        # version at once, a NaN drain_timeout never forced one; True is no count.
        _count("keep", self.keep, minimum=1, what="versions kept loaded per engine, e.g. 2")
        _seconds("grace", self.grace, what="seconds an old version stays when the engine cannot report requests, e.g. 1.0")
        if self.drain_timeout is not None:
            _seconds("drain_timeout", self.drain_timeout, what="seconds a version may wait for its requests, e.g. 600; None waits for ever")
        _count("max_deferred", self.max_deferred, minimum=0, what="versions per engine waiting for their requests, e.g. 8")
        if self.max_staleness is not None:
            _count("max_staleness", self.max_staleness, minimum=0, what="versions behind the newest never retired, or None")
        if not isinstance(self.background, bool):
            raise ConfigError(f"background must be True or False, got {self.background!r}")

    def window(self, loaded: list[int], pins: set[int] | frozenset[int]) -> set[int]:
        """The versions of ``loaded`` that must stay: newest ``keep``, pinned, and not too stale."""
        ordered = sorted(loaded)
        kept = set(ordered[-self.keep :]) | (set(ordered) & set(pins))
        if self.max_staleness is not None and ordered:
            newest = ordered[-1]
            kept |= {v for v in ordered if newest - v <= self.max_staleness}
        return kept


#: A source still to be read from the engine: the token it gives the tensor load just made.
LEARN = "\0learn"


def _count(name: str, value: object, *, minimum: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a bool" if isinstance(value, bool) else type(value).__name__
        raise ConfigError(f"{name} must be an int >= {minimum} ({what}), got {value!r} ({kind})")


def check_timeout(timeout: object) -> None:
    """A drain ``timeout`` given to ``retire``/``remove_engine``: None (the drain_timeout) or
    seconds. Checked before anything starts: a NaN never expired (a lease held meant a retirement
    that never ended) and a string failed with a TypeError halfway through.

    Raises:
        ConfigError: a bool, NaN, infinity, a negative number or not a number.
    """
    if timeout is not None:
        _seconds("timeout", timeout, what="seconds to wait for requests and leases before unloading anyway; None: the drain_timeout")


def _seconds(name: str, value: object, *, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        kind = "a bool" if isinstance(value, bool) else type(value).__name__
        raise ConfigError(f"{name} must be a finite number >= 0 ({what}), got {value!r} ({kind})")


@dataclass
class Ledger:
    """What a publisher knows about one engine (mutable; the publisher's lock guards it).

    A content hash in ``versions`` counts only while the engine serves the very load it was taken
    of (design invariant 8): ``sources`` keeps where each of this publisher's loads came from (its
    files, or the token the engine reported right after a tensor load), and
    :meth:`EngineHandle.sync` drops a hash whose name the engine now serves from elsewhere.
    """

    synced: bool = False  # ``versions`` was read from the engine since the last failure
    versions: dict[int, str | None] = field(default_factory=dict)  # loaded version -> content hash (None: unknown)
    sources: dict[int, str] = field(default_factory=dict)  # version -> where the load this hash is of came from
    left_window: dict[int, float] = field(default_factory=dict)  # version -> when it left the window
    merged: tuple[int, str] | None = None  # (version, hash) merged into the base
    # (version, hash, restore point) served in place: the version's files (a path), an owned copy,
    # or the Adapter it was published from (restored only through a copy that still has the hash).
    in_place: tuple[int, str, object] | None = None
    in_place_source: str | None = None  # the engine's source of the in-place name after our swap
    # Versions whose verification did not pass (design invariant 11) and that the engine may still
    # list because taking them out failed: no hash, outside every window, unloaded first.
    unverified: set[int] = field(default_factory=set)
    # In place or merged, the newest version that may still serve after taking it out failed
    # (what serves is unknown then, not gone): no older version may replace it.
    floor: int | None = None

    def newest(self) -> int | None:
        return max(self.versions, default=None)

    def holds(self, version: int) -> bool:
        """``version`` is recorded as served here: loaded under its name, in place or merged."""
        return version in self.versions or any(e is not None and e[0] == version for e in (self.in_place, self.merged))

    def forget(self, version: int) -> None:
        self.versions.pop(version, None)
        self.sources.pop(version, None)
        self.left_window.pop(version, None)
        self.unverified.discard(version)

    def unchanged(self, *, versioned: bool, version: int, digest: str) -> bool:
        """The engine already serves identical content at ``version`` or below: nothing to move."""
        if not versioned:
            current = self.merged if self.merged is not None else (self.in_place[:2] if self.in_place else None)
            return current is not None and current[1] == digest and current[0] <= version
        newest = self.newest()
        return newest is not None and newest <= version and self.versions[newest] == digest

    def listed_unknown(self, version: int) -> bool:
        """The engine lists ``version`` as its newest, from a load whose content cannot be known
        (no hash: SGLang names no source for a tensor load), and nothing says it failed a probe."""
        return self.newest() == version and self.versions[version] is None and version not in self.unverified

    def check_monotonic(self, name: str, *, versioned: bool, version: int, digest: str) -> None:
        """Refuse a version that would replace a newer (or the same, with other content) one.

        Raises:
            StaleVersionError: with the newest version the engine serves.
        """
        if versioned:
            newest = self.newest()
            newest_hash = self.versions.get(newest) if newest is not None else None
        else:
            current = self.merged if self.merged is not None else (self.in_place[:2] if self.in_place else None)
            newest, newest_hash = current if current is not None else (None, None)
            if self.floor is not None and (newest is None or self.floor > newest):
                newest, newest_hash = self.floor, digest  # its content is unknown: only older versions are refused
        if newest is None:
            return
        if version < newest or (version == newest and newest_hash != digest):
            raise StaleVersionError(
                f"{name} v{version} would replace v{newest}, which the engine already serves; versions "
                "must increase (use the trainer step). Nothing was changed. A re-run of a training "
                f"script against the same engine: publish under a new name= (e.g. name='{name}-2'), or "
                f"number this run's versions after v{newest} (version={newest} + step). A new run= alone "
                "does not help: it keeps two runs' files apart, not the names the engine serves (pass "
                "the earlier run= to resume its files, with versions after its newest)",
                adapter=name,
                version=version,
                newest=newest,
            )


@dataclass
class Plan:
    """What to do with the versions outside the window: ``unload`` now, or leave ``deferred``."""

    unload: list[int] = field(default_factory=list)
    deferred: list[int] = field(default_factory=list)
    forced: list[tuple[int, str]] = field(default_factory=list)  # (version, why) unloaded while requests may use it


def plan(
    ledger: Ledger,
    policy: Retention,
    *,
    name_of: dict[int, str],
    in_use: frozenset[str] | None,
    pins: set[int] | frozenset[int],
    now: float,
    closing: bool = False,
    drains: bool = False,
) -> Plan:
    """Decide, without I/O, which loaded versions outside the window leave now.

    Args:
        ledger (`Ledger`): the engine's versions; ``left_window`` is updated (first time a version
            is seen outside the window).
        policy (`Retention`): the rules.
        name_of (`dict[int, str]`): served name of each version.
        in_use (`frozenset[str] | None`): served names with running or waiting requests; None when
            the engine cannot tell.
        pins (`set[int]`): versions that must stay.
        now (`float`): monotonic time.
        closing (`bool`): the publisher is closing (deferral bounds still apply).
        drains (`bool`): the engine's own unload waits for its requests (no grace needed).

    Returns:
        `Plan`: versions to unload (oldest first) and versions deferred.
    """
    window = policy.window([v for v in ledger.versions if v not in ledger.unverified], pins)
    out = sorted(v for v in ledger.versions if v not in window)
    for v in list(ledger.left_window):
        if v not in out:
            del ledger.left_window[v]  # back in the window (pinned again) or gone
    result = Plan()
    waiting: list[int] = []
    for v in out:
        if v in ledger.unverified:  # never served verified: nothing may rightly use it
            result.unload.append(v)
            continue
        since = ledger.left_window.setdefault(v, now)
        if in_use is None:
            busy = (now - since) < policy.grace and not closing and not drains
        else:
            busy = name_of[v] in in_use
        if not busy:
            result.unload.append(v)
            continue
        if policy.drain_timeout is not None and now - since >= policy.drain_timeout:
            result.unload.append(v)
            held = "requests still used it" if in_use is not None else f"the engine cannot report requests and its grace period (grace={policy.grace:g} s) had not ended"
            result.forced.append((v, f"{held} {now - since:.0f} s after it left the window (drain_timeout={policy.drain_timeout:g} s)"))
            continue
        waiting.append(v)
    while len(waiting) > policy.max_deferred:
        v = waiting.pop(0)
        result.unload.append(v)
        if in_use is None:  # nothing says a request used it: only its grace period had not ended
            result.forced.append((v, (
                f"the engine cannot report requests in flight, and more than max_deferred={policy.max_deferred} versions "
                f"were inside their grace period (grace={policy.grace:g} s; publishing faster than that keeps them all)"
            )))
        else:
            result.forced.append((v, f"requests still used it, and more than max_deferred={policy.max_deferred} versions were waiting for theirs"))
    result.unload.sort()
    result.deferred = waiting
    return result
