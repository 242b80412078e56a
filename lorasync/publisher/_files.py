"""Version files: when a version's directory may leave the store.

Design invariant 5 for files: a version's directory is deleted only after every engine that
loaded it has unloaded it and drained it. vLLM reloads an evicted adapter from its path for a
running request (and its engine core dies if the files are gone), so on such engines the files
also outlive the unload by the retention ``grace`` and for as long as the engine still reports the
name in use. Who holds a version is recorded beside its files (``DiskStore.record``), so another
job's orphan sweep, after this process is gone, keeps what an engine it cannot ask may reload.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from lorasync.runtime._loop import to_thread
from lorasync.adapter._names import served_name, validate_name, validate_version
from lorasync.engines._engine import is_in_process_id
from lorasync.errors import LoraSyncError
from lorasync.transports._layout import read_version_file
from lorasync.transports._store import META, DiskStore

__all__ = ["VersionFiles"]


class VersionFiles:
    """Holders and unload times of one run's versions of one name; collects what may go.

    Args:
        store (`DiskStore`): the run's store.
        name (`str`): the adapter name.
        grace (`float`): seconds files outlive the unload on engines that reload from paths.
    """

    def __init__(self, store: DiskStore, name: str, *, grace: float) -> None:
        self.store = store
        self.name = name
        self.grace = grace
        self._holders: dict[int, set[str]] = {}
        self._reloaders: dict[int, set[str]] = {}  # holders that may reload from the path
        self._unloaded: dict[int, float] = {}  # version -> wall time the last reloading holder let go
        self._swept = False
        store.holders_of = lambda name, version: self._holders.get(version, ()) if name == self.name else ()

    def loading(self, version: int, engine_id: str, *, reloads: bool) -> None:
        """Before a load: ``engine_id`` may hold ``version`` from now on (recorded first, so a
        crash right after the load still leaves a truthful record). Added to whoever the run's
        record already names: the stateless calls of a process share a run, one engine each."""
        holders = self._holders.get(version)
        if holders is None:
            record = self.store.record_of(self.name, version)
            holders = self._holders[version] = set(record[0]) if record is not None else set()
        holders.add(engine_id)
        if reloads:
            self._reloaders.setdefault(version, set()).add(engine_id)
        self._unloaded.pop(version, None)
        self.store.record(self.name, version, holders=self._holders[version])

    def released(self, version: int, engine_id: str, *, reloads: bool = False) -> None:
        """``engine_id`` no longer holds ``version`` (unloaded, failed to load, or lost it);
        ``reloads``: that engine may still re-read the files for a request it admitted."""
        holders = self._holders.get(version)
        if holders is None:
            # Loaded by an earlier publisher of this run (a stateless call): its record says who.
            record = self.store.record_of(self.name, version)
            if record is None:
                return
            holders = self._holders[version] = set(record[0])
        if engine_id not in holders:
            return
        holders.discard(engine_id)
        if reloads or engine_id in self._reloaders.get(version, ()):
            self._unloaded[version] = time.time()
        self.store.record(self.name, version, holders=holders, unloaded_at=self._unloaded.get(version))

    def held(self) -> set[int]:
        return {v for v, h in self._holders.items() if h}

    def path_of(self, version: int) -> str:
        """This run's directory of ``version``, as engines are given it (absolute)."""
        return os.path.abspath(self.store.path_for(self.name, version))

    def content_hash_at(self, path: str, version: int) -> str | None:
        """The content hash recorded with the version directory at ``path`` (where an engine says
        it loaded the adapter from) when that is ``version`` of this name in a run under the
        store's root; None otherwise. A version directory is never rewritten (a write renames a
        complete temp into place, a removal renames it away first), so the hash names the bytes
        the engine read, whichever run wrote them. Nothing is followed through a symlink.
        """
        found = Path(os.path.abspath(path))
        if found.name != f"v{validate_version(version)}" or found.parent.name.startswith("."):
            return None
        if found.parent.parent != Path(os.path.abspath(self.store.root / validate_name(self.name))):
            return None
        try:
            if found.is_symlink() or found.parent.is_symlink():
                return None
        except OSError:
            return None
        # Bounded, not through a symlink, and a record no parser follows is None (another run's
        # file: anyone who can write under the root may have left it).
        meta = read_version_file(found, META)
        if not isinstance(meta, dict) or meta.get("name") != self.name or meta.get("version") != version:
            return None
        digest = meta.get("content_hash")
        return digest if isinstance(digest, str) else None

    async def collect(
        self,
        *,
        current: int,
        keep: int,
        held: Iterable[int],
        pins: Iterable[int],
        in_use: Iterable[str] | None,
    ) -> list[int]:
        """Delete this run's version directories that nothing may read again.

        Never deleted: versions an engine holds (``held``), pinned ones, the newest ``keep`` on
        disk, ``current`` and newer, versions unloaded less than ``grace`` ago from an engine that
        reloads from paths, and versions such an engine still reports in use (``in_use``: the
        names engines report in use; None when they cannot tell, then the grace alone decides).

        Returns:
            The versions removed.
        """
        published = await to_thread(self.store.versions, self.name)
        protected = set(held) | set(pins) | set(sorted(published)[-keep:])
        busy = None if in_use is None else set(in_use)
        now = time.time()
        removed: list[int] = []
        for version in published:
            if version >= current or version in protected:
                continue
            unloaded = self._unloaded.get(version)
            if unloaded is None:
                record = self.store.record_of(self.name, version)
                if record is not None:
                    if record[0]:
                        continue  # an earlier publisher of this process recorded holders
                    unloaded = record[1]
            if unloaded is not None:
                if now - unloaded < self.grace:
                    continue
                if busy is not None and served_name(self.name, version) in busy:
                    continue  # unloaded anyway (drain timeout), but a request still runs on it
            try:
                await to_thread(self.store.remove, self.name, version)
            except LoraSyncError:
                continue  # best effort: a later publish collects it
            self._holders.pop(version, None)
            self._reloaders.pop(version, None)
            self._unloaded.pop(version, None)
            removed.append(version)
        return removed

    def sweep_orphans(self, engines_lists: dict[str, set[str]]) -> list[int]:
        """Once per publisher: remove versions of dead runs of this name that no engine may reload.

        Args:
            engines_lists (`dict[str, set[str]]`): for each engine this publisher drives (by id),
                the names it serves now. A dead run's version stays if it was recorded on an engine
                not in this mapping, or on one that still lists its served name.

        Returns:
            How many version directories were removed.
        """
        if self._swept:
            return []
        self._swept = True

        def keep(run: str, version: int) -> bool:
            record = self.store.record_of(self.name, version, run=run)
            if record is None:
                return False  # never recorded as loaded anywhere
            for holder in record[0]:
                if is_in_process_id(holder):
                    continue  # an in-process engine: gone with the run's process
                names = engines_lists.get(holder)
                if names is None or served_name(self.name, version) in names:
                    return True
            return False

        try:
            return [int(p.name[1:]) for p in self.store.sweep_orphans(self.name, keep=keep)]
        except OSError:
            return []
