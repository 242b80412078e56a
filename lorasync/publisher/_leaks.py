"""Slots that an unload did not free: after retiring versions, ask the engine whether they left.

An engine's unload can answer success and keep the adapter: vLLM's ``/v1/unload_lora_adapter``
drops only the API server's registry entry in some versions (vLLM issues #54839, #42633), and
an engine may keep serving a retired name to requests still running on it. A long run would then
leak slots until loads fail or memory runs out. :class:`SlotLeaks` judges each retired name at
the next moment the publisher looks at the engine anyway (the listing before a load and the one
when a publish settles; engines with their own LoRA list at once), so the check costs no request
of its own. It looks where the engine lets it:

* the names the engine lists (``list_adapters``: ``/v1/models`` over HTTP) — a retired name
  still listed is held, for sure;
* the engine's own LoRA list, for engines that have one (``aheld_adapters()``: the in-process
  vLLM engine reads vLLM's ``list_loras``) — likewise for sure;
* the names with requests (``adapters_in_use``: vLLM's ``/metrics`` gauge) — it lags by a step,
  so a retired name seen there counts as held for capacity at once, and is reported only when a
  later check still sees it.

Every name held is reported once with a :class:`~lorasync.errors.SlotLeakWarning` that says what
to do, and the capacity planner counts it as occupied until the engine stops reporting it (a
name with requests only is not a leak unless a later check still sees it; one that retention
unloaded by force while requests used it is never reported for its requests alone: its
``RetentionWarning`` already said so, and the engine serving those requests on is what a forced
unload means. It stays occupied for capacity until they end, but is no sign that the engine's
unloads free nothing: :attr:`SlotLeaks.kept` leaves it out). A check at which the requests could
not be read (``/metrics`` timed out) keeps every name seen with requests where it stood, for
:data:`UNKNOWN_CHECKS` checks in a row: unknown is not "none", but a report that never comes back
is (the lists judge alone then, as on an engine that has none).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Collection, Iterable

from lorasync.engines._engine import Engine
from lorasync.errors import EngineError, SlotLeakWarning

__all__ = ["SlotLeaks", "UNKNOWN_CHECKS"]

#: Checks in a row without a reading of the engine's requests for which a name seen with requests
#: keeps its standing; after them its lists alone judge it (requests that cannot be read are none).
UNKNOWN_CHECKS = 2

log = logging.getLogger("lorasync.publish")


class SlotLeaks:
    """The retired names one engine may still hold (see the module docstring).

    It sends no request of its own but the engine's own LoRA list (``aheld_adapters``, where the
    engine has one): the listings and request reports it judges by are the ones the publisher
    reads anyway (before a load, when it settles), so a retired name is judged at the next one.

    Args:
        engine (`Engine`): the engine.
        where (`str`): the engine as messages name it.
    """

    def __init__(self, engine: Engine, where: str) -> None:
        self.engine = engine
        self.where = where
        self.pending: set[str] = set()  # retired, not judged yet
        self.suspects: set[str] = set()  # retired names found held: counted as occupied
        self.freed: list[str] = []  # suspects the last check found gone
        self._busy: set[str] = set()  # retired names seen with requests once (not yet suspects)
        self._reported: set[str] = set()
        self._forced: set[str] = set()  # unloaded by retention while requests used them
        self._held: set[str] = set()  # listed or held for sure at the last check
        self._by_requests: set[str] = set()  # suspects for their requests alone (not listed or held)
        self._unknown = 0  # checks in a row at which the requests could not be read

    def forced_out(self, names: Iterable[str]) -> None:
        """Retention unloads ``names`` while requests may still use them: their requests going on
        afterwards is the forced unload itself, not a slot the engine kept."""
        self._forced |= set(names)

    @property
    def kept(self) -> frozenset[str]:
        """The suspects the engine kept although their unload answered: evidence that its unloads
        may free no slot (the capacity planner then counts on none). A name forced out under its
        requests that the engine only reports requests on is occupied until they end, but says
        nothing of that; one it still lists or holds does."""
        return frozenset(self.suspects - (self._forced - self._held))

    @property
    def watching(self) -> bool:
        """Some retired name waits to be judged or is still held."""
        return bool(self.pending or self.suspects or self._busy)

    def loaded_again(self, name: str) -> None:
        """lorasync loaded ``name`` again after retiring it (a fleet restores a version that a
        failed or cancelled retire/remove_engine had unloaded): the engine holds it because it was
        asked to, not because its unload kept it, so it is no longer judged."""
        for names in (self.pending, self.suspects, self._busy, self._reported, self._forced):
            names.discard(name)

    async def check(
        self, retired: Iterable[str] = (), *, listed: Collection[str] | None = None, busy: Collection[str] | None = None
    ) -> frozenset[str]:
        """Judge the retired names (``retired`` now, and earlier ones) by what the engine reports.

        Args:
            retired: served names just unloaded.
            listed: what the engine lists now (None: no listing at hand).
            busy: the names with requests now, as last read (None: unknown).

        Returns:
            The names it lists or holds for sure (their files must stay). Names it only reports
            requests on become suspects when a later check still sees them.
        """
        self.pending |= set(retired)
        self.freed = []
        names = self.pending | self.suspects | self._busy
        held_fn = getattr(self.engine, "aheld_adapters", None)
        if not names or (listed is None and held_fn is None):
            return frozenset()
        try:
            held = set(await held_fn()) if held_fn is not None else set()
        except EngineError as exc:
            log.warning("%s: cannot tell whether unloaded adapters left it (%s)", self.where, exc)
            return frozenset()
        sure = names & (set(listed or ()) | held)
        self._unknown = self._unknown + 1 if busy is None else 0
        if busy is None and self._unknown <= UNKNOWN_CHECKS:
            # Requests unknown at this check (their report failed): a name seen with requests keeps
            # its standing (its files stay) until a check can tell, as a held list that could not
            # be read keeps it above. Past UNKNOWN_CHECKS in a row the report is taken for gone
            # and the lists judge alone, so a phantom never holds a slot for the rest of the run.
            lingering = (self._busy | self._by_requests) - sure
            persistent = lingering & self._by_requests
        else:
            lingering = (names & set(busy or ())) - sure
            persistent = lingering & (self._busy | self.suspects)  # seen with requests at two checks in a row (or more)
        self.freed = sorted(self.suspects - sure - persistent)
        self.suspects = sure | persistent
        self._held, self._by_requests = set(sure), persistent - sure
        self._busy = lingering - persistent
        self.pending = set()
        self._forced &= self.suspects | self._busy  # judged like any other name once its requests ended
        self._reported &= self.suspects  # a name that left is never judged again: a long run keeps no trace of it
        report = sorted(self.suspects - self._reported - (persistent & self._forced))
        if report:
            self._reported.update(report)
            warnings.warn(
                SlotLeakWarning(
                    f"{self.where} answered the unload of {', '.join(report)} but still "
                    + ("lists or holds" if set(report) <= sure else "reports requests on")
                    + " them, so their slots and memory are not free; lorasync counts them as occupied. Remedy: "
                    "upgrade the engine (vLLM frees unloaded adapters only where its unload calls remove_lora: "
                    "vLLM #54839), size its cache above the versions you keep plus these (vLLM --max-cpu-loras, "
                    "SGLang --max-loaded-loras), or restart it between runs",
                    engine=getattr(self.engine, "kind", ""),
                    url=getattr(self.engine, "url", ""),
                    adapters=tuple(report),
                ),
                stacklevel=2,
            )
        return frozenset(sure)
