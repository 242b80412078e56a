"""DiskStore: atomic, versioned adapter directories that belong to one run (one publisher).

Layout: ``<root>/<name>/<run>/v<version>/{adapter_model.safetensors, adapter_config.json,
lorasync.json}``. Every publisher owns one run directory per adapter name, so two jobs on one
host (or a re-run of the same training) never collide on a version and never delete each other's
files; the run is chosen at random by default and can be set (``run=``) to resume one.

The store is a trust boundary (design invariant 9, :mod:`lorasync.transports._trust`): the root,
the name folders and the runs belong to the current user, are writable by no one else and are no
symlinks, or the store refuses them; everything it creates is ``0700``/``0600``; below the root
nothing is followed through a symlink (every step opens with ``O_NOFOLLOW`` relative to its
folder's descriptor). The default root is the user's own (``/dev/shm/lorasync-<uid>``). Entries
the store did not make (a copied run, stray files, ``v3 (copy)``) are foreign: never parsed as
runs or versions, never deleted.

Ownership is a lock, not a PID: the live owner holds ``flock(LOCK_EX)`` on ``<run>/.owner.lock``
from its first write until the process exits (the kernel drops it when the process dies, on any
host that shares the filesystem's lock semantics, in any PID namespace). A forked child owns
nothing: an ``os.register_at_fork`` hook (:mod:`lorasync.transports._owned`) closes its copies of the lock descriptors (a flock is
shared with every copy of the descriptor, so a data-loader worker would otherwise keep a dead
trainer's run "alive"), and a store made before the fork refuses to write in the child. A run
whose lock can be taken has no live owner: :meth:`DiskStore.sweep_orphans` removes its versions
except the ones an engine may still reload (the caller says which).

A version is written into a hidden temp directory inside the run, fsynced, then renamed into
place, so a reader (an engine) sees a complete version or none. A failed write removes its temp
directory at once (a full disk leaves nothing behind). A published version is never rewritten;
removal renames it to a hidden trash name first, so a half-deleted directory is never visible
under a published name. (Over 400 lines because the run's whole life, owned, written, recorded
and swept, is one class whose methods share its checks.)
"""

from __future__ import annotations

import errno
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

from lorasync.adapter._adapter import Adapter
from lorasync.adapter._names import validate_name, validate_version
from lorasync.errors import ConfigError, PublishError, StorageError
from lorasync.transports._fsutil import errno_of, remove_tree_at, remove_version
from lorasync.transports._layout import HOLDERS, META, OWNER_LOCK, begin_run, end_run_at, put_holders, read_version_file, runs_at, seal_version, sweep_dead_runs, take_run
from lorasync.transports._layout import recorded_hash as _recorded_hash  # META, OWNER_LOCK: also here, for callers
from lorasync.transports._layout import versions_in as _versions_in
from lorasync.transports._owned import GUARD, LIVE, OWNED
from lorasync.transports._trust import check_ancestors, folders, make_ancestors, root_path

__all__ = ["DiskStore", "WriteNotWanted", "default_root", "new_run_id"]

_SHM = Path("/dev/shm")


class WriteNotWanted(Exception):  # noqa: N818 - raised to a caller that asked for it
    """A write whose ``wanted`` check answered False: nothing of it was left in the run."""


def default_root() -> Path:
    """This user's own store root: ``/dev/shm/lorasync-<uid>`` (tmpfs: memory speed, no disk
    wear) when ``/dev/shm`` is writable, else ``<temp dir>/lorasync-<uid>``. One per user, so two
    local users never share (or squat) one."""
    folder = f"lorasync-{os.geteuid()}"
    if _SHM.is_dir() and os.access(_SHM, os.W_OK):
        return _SHM / folder
    return Path(tempfile.gettempdir()) / folder


def new_run_id() -> str:
    """A fresh run identity: UTC time (sortable, readable) plus 48 random bits (unique)."""
    return time.strftime("run-%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(6)


class DiskStore:
    """Versioned adapter directories of one run (see module docstring).

    Args:
        root (`str | os.PathLike`, *optional*): defaults to :func:`default_root`. For engines on
            other hosts use a shared filesystem path they see at the same location. It must be
            yours and writable by no one else (it is created ``0700`` when missing).
        run (`str`, *optional*): this store's run identity (a name: letters, digits, ``._-``).
            Default: a fresh :func:`new_run_id`. Pass the same run to resume it after a restart;
            two live stores cannot own one run at once.

    Raises:
        InvalidNameError: ``run`` is not a valid name.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, *, run: str | None = None) -> None:
        self.root = Path(os.path.abspath(root_path(root))) if root is not None else default_root()
        self.run = validate_name(run) if run is not None else new_run_id()
        self._owner: dict[str, Path] = {}
        self._pid = os.getpid()
        self._checked = False  # the folders above the root
        self._closed = False
        # Who will hold a version being written (the publisher's intent, set before each load), so
        # the record exists from the moment the version is visible: see :meth:`record`.
        self.holders_of: Callable[[str, int], Iterable[str]] | None = None

    # -- paths --------------------------------------------------------------------------------

    def run_dir(self, name: str) -> Path:
        """This run's directory for adapter ``name``."""
        return self.root / validate_name(name) / self.run

    def path_for(self, name: str, version: int) -> Path:
        """Where version ``version`` of ``name`` lives (validated; never escapes ``root``)."""
        return self.run_dir(name) / f"v{validate_version(version)}"

    def versions(self, name: str) -> list[int]:
        """Complete published versions of ``name`` in this run, ascending."""
        return _versions_in(self.run_dir(name))

    def content_hash(self, name: str, version: int) -> str | None:
        """The content hash recorded for a published version of this run, or None if absent."""
        return _recorded_hash(self.path_for(name, version))

    def content_hash_held_by(self, name: str, version: int, holder: str) -> str | None:
        """The content hash of ``version`` of ``name`` in this run, if this run recorded
        ``holder`` (an engine's ``instance_id``) as holding it — how a resumed publisher
        recognises what an engine serves. Never another run's: two jobs on one engine both
        record it, and which of them loaded what the engine serves now no record can tell
        (the path the engine names can: ``VersionFiles.content_hash_at``).
        """
        record = self.record_of(name, version)
        if record is None or holder not in record[0]:
            return None
        return self.content_hash(name, version)

    # -- ownership ----------------------------------------------------------------------------

    def own(self, name: str) -> Path:
        """Take (once) the owner lock of this run's directory for ``name``; returns the directory.

        The lock stays with this process until it exits (also after :meth:`close`), so another
        job's sweep never takes a run whose in-process engines may still be serving; a later
        store of this process may take the run over once this one is closed.

        Raises:
            ConfigError: another live store (this process or another) owns the run already, or
                this store was made by the parent of this forked process.
            StorageError: the directory or lock cannot be created, or a folder of the store is
                not the current user's alone (see :mod:`lorasync.transports._trust`).
        """
        self._same_process()
        run_dir = self.run_dir(name)
        if name in self._owner:
            return run_dir
        with self._name_dir(name, create=True) as name_fd:
            assert name_fd is not None
            with GUARD:
                if name in self._owner:  # another thread of this store took it meanwhile
                    return run_dir
                if run_dir in LIVE:
                    raise ConfigError(
                        f"run {self.run!r} of {name!r} under {self.root} is in use by another publisher of this process; "
                        "give each publisher its own run= (or leave run= unset for a fresh one)"
                    )
                run_fd, lock = take_run(name_fd, self.run, run_dir, name, locked=run_dir in OWNED)
                if lock is not None:
                    OWNED[run_dir] = lock
                LIVE.add(run_dir)
                self._owner[name] = run_dir
        begin_run(run_fd, self.run)
        return run_dir

    def close(self) -> None:
        """Stop using this run (files stay; the process keeps the run's lock; idempotent).

        Never waits (a collected publisher's finalizer calls it; see :class:`~lorasync.transports._owned.Guard`)."""
        self._closed = True
        owned, self._owner = list(self._owner.values()), {}
        GUARD.free(owned)

    @property
    def closed(self) -> bool:
        """:meth:`close` was called: nothing may take this run again through this store."""
        return self._closed

    def end_run(self, name: str) -> bool:
        """Give this run of ``name`` up for good (its folder, then its lock) once no version is left
        in it: False (still owned) otherwise. A Fleet's retirement: register / retire cycles keep
        descriptors and the store flat. Raises ConfigError as :meth:`own`."""
        self._same_process()
        run_dir = self.run_dir(name)
        with self._name_dir(name, create=False) as name_fd, GUARD:
            if name_fd is not None and not end_run_at(name_fd, self.run):
                return False
            if (lock := OWNED.pop(run_dir, None)) is not None:
                os.close(lock)  # after the folder went: no sweep can take a run still in it
            LIVE.discard(run_dir)
            self._owner.pop(name, None)
        return True

    def runs(self, name: str) -> list[str]:
        """Every run directory of ``name`` under the root (this run included): real folders of
        this user named like a run, holding a run's lock and no other run's ``run.json``.
        Anything else there is foreign and left alone.

        Raises:
            StorageError: the root or the name's folder is not the current user's alone.
        """
        with self._name_dir(name, create=False) as name_fd:
            return [] if name_fd is None else runs_at(name_fd)

    def sweep_orphans(self, name: str, *, keep: Callable[[str, int], bool]) -> list[Path]:
        """Remove versions of runs of ``name`` that no live store owns.

        Args:
            name (`str`): the adapter name.
            keep (`Callable[[str, int], bool]`): ``keep(run, version)`` is True for a version an
                engine may still reload (it stays, and so does its run directory).

        Returns:
            The version directories removed (all inside the root: nothing is followed through a
            symlink, and foreign entries stay).
        """
        with self._name_dir(name, create=False) as name_fd:
            if name_fd is None:
                return []
            # GUARD: against this process's stores taking a run right now; its own earlier runs
            # (OWNED) stay: their in-process engines may still serve them.
            return sweep_dead_runs(name_fd, self.root / name, mine=self.run, guard=GUARD, owned=OWNED, keep=keep)

    # -- versions -----------------------------------------------------------------------------

    def write(self, adapter: Adapter, name: str, version: int) -> tuple[Path, int]:
        """Publish ``adapter`` as ``name`` version ``version`` of this run; idempotent for equal content.

        Returns:
            ``(path, bytes_written)``; ``bytes_written`` is 0 when the identical version existed.

        Raises:
            PublishError: the version exists in this run with different content (versions are immutable).
            StorageError: the filesystem failed (nothing partial is left behind).
        """
        path, written, _ = self.write_hashed(adapter, name, version)
        return path, written

    def write_hashed(self, adapter: Adapter, name: str, version: int, *, wanted: Callable[[], bool] | None = None) -> tuple[Path, int, str]:
        """:meth:`write`, and the content hash of exactly the bytes written, from the write pass.

        Args:
            wanted: asked right before the new version is put in place and right after; once False
                (its publish was cancelled) the version is not put in place, or taken out again
                (through the run's folder held open), and :class:`WriteNotWanted` is raised.

        Returns:
            ``(path, bytes_written, content_hash)``; the recorded hash when the identical version
            existed (then nothing is written).

        Raises:
            PublishError, StorageError: as :meth:`write`. ConfigError: as :meth:`own`.
            WriteNotWanted: ``wanted`` answered False; nothing of this write is left.
        """
        final = self.path_for(name, version)
        with self._run(name) as run_fd:
            return self._write_at(run_fd, adapter, name, version, final, wanted)

    def _write_at(self, run_fd: int, adapter: Adapter, name: str, version: int, final: Path, wanted: Callable[[], bool] | None = None) -> tuple[Path, int, str]:
        existing = _recorded_hash((run_fd, final.name))
        if existing is not None:
            if adapter.matches_hash(existing):
                return final, 0, existing
            raise PublishError(
                f"{name} v{version} is already published in run {self.run!r} at {final} with different content; "
                "published versions are immutable: publish under a higher version (or a new run)",
                adapter=name,
                version=version,
            )
        tmp = f".tmp-v{version}-{secrets.token_hex(4)}"
        digest = ""
        try:
            os.mkdir(tmp, 0o700, dir_fd=run_fd)
            # Never the run's folder again (parents=False): a run given up meanwhile stays gone.
            digest = adapter.save_hashed(final.parent / tmp, parents=False)[1]  # the hash of the bytes written, same pass
            meta = {"name": name, "version": version, "run": self.run, "content_hash": digest, "created": time.time()}
            holders = None if self.holders_of is None else sorted(set(self.holders_of(name, version)))
            written = seal_version(run_fd, tmp, meta, holders)
            if wanted is not None and not wanted():
                raise WriteNotWanted(f"{name} v{version}: the publish that asked for it was cancelled")
            os.rename(tmp, final.name, src_dir_fd=run_fd, dst_dir_fd=run_fd)
            os.fsync(run_fd)
            if wanted is not None and not wanted():  # cancelled while it was put in place
                remove_version(run_fd, final.name)
                raise WriteNotWanted(f"{name} v{version}: its publish was cancelled")
        except OSError as exc:
            remove_tree_at(run_fd, tmp)
            there = _recorded_hash((run_fd, final.name)) if errno_of(exc) in (errno.ENOTEMPTY, errno.EEXIST) else None
            if there is not None:
                # Only this run's owner writes here, so this is a second writer of the same version
                # inside this publisher; equal content is the same publish.
                if there == digest:
                    return final, 0, digest
                raise PublishError(
                    f"{name} v{version} was published concurrently with different content in run {self.run!r}; "
                    "publish each version once",
                    adapter=name,
                    version=version,
                ) from exc
            if os.path.lexists(final):
                raise StorageError(f"{final} is in the way and is no version lorasync wrote; move it away or publish another version", adapter=name, version=version) from exc
            if errno_of(exc) == errno.ENOSPC:
                raise StorageError(
                    f"cannot publish {name} v{version}: the store's filesystem ({self.root}) is full; free space, lower keep=, "
                    "or use a bigger root= (nothing of this version was left behind)",
                    adapter=name,
                    version=version,
                ) from exc
            raise StorageError(f"cannot publish {name} v{version} under {self.root}: {exc}; check free space and permissions", adapter=name, version=version) from exc
        except BaseException:
            remove_tree_at(run_fd, tmp)
            raise
        return final, written, digest

    def record(self, name: str, version: int, *, holders: Iterable[str], unloaded_at: float | None = None) -> None:
        """Record which engines hold a version of this run, and when the last one let it go (so
        a sweep keeps files an engine may reload, and a later publisher keeps them through the
        grace). Best effort: a failed write is ignored (then nobody known holds the version).

        Raises:
            ConfigError, StorageError: as :meth:`own` (only this run's owner writes in it).
        """
        if not os.path.isdir(self.path_for(name, version)):
            return
        try:
            with self._run(name) as run_fd:
                put_holders(run_fd, version, sorted(set(holders)), unloaded_at)
        except (OSError, ConfigError):
            pass  # StorageError is an OSError; ConfigError: not this run's owner (a forked child)

    def record_of(self, name: str, version: int, *, run: str | None = None) -> tuple[list[str], float | None] | None:
        """``(holders, unloaded_at)`` recorded for ``version`` of ``name`` in ``run`` (default: this
        run); None when nothing was recorded.

        Raises:
            StorageError: the root or the name's folder is not the current user's alone.
        """
        run = self.run if run is None else validate_name(run)
        found = read_version_file(self.root / validate_name(name) / run / f"v{validate_version(version)}", HOLDERS)
        try:
            holders = [str(h) for h in found["holders"]]  # type: ignore[index]
            unloaded = found.get("unloaded_at")  # type: ignore[union-attr]
            return holders, float(unloaded) if unloaded is not None else None
        except (AttributeError, ValueError, KeyError, TypeError):
            return None

    def remove(self, name: str, version: int) -> None:
        """Delete a version of this run: first renamed out of sight, then removed.

        Raises:
            ConfigError: as :meth:`own`.
            StorageError: the rename failed for another reason than the version being gone.
        """
        final = self.path_for(name, version)
        try:
            with self._run(name) as run_fd:
                remove_version(run_fd, final.name)
        except StorageError:
            raise
        except OSError as exc:
            raise StorageError(f"cannot remove {final}: {exc}", adapter=name, version=version) from exc

    # -- the tree -----------------------------------------------------------------------------

    def _same_process(self) -> None:
        if os.getpid() != self._pid:
            raise ConfigError(
                f"this store (run {self.run!r} under {self.root}) was made by process {self._pid}, the parent of this forked "
                "process: a forked child owns no run of its parent and never writes in one; make a new Publisher in the "
                "child (it takes a run of its own)"
            )

    def _name_dir(self, name: str, *, create: bool) -> AbstractContextManager[int | None]:
        """``<root>/<name>`` opened and checked (created ``0700`` with ``create``); None when
        missing, or (without ``create``: a read) not to be trusted, so nothing in it is believed.
        The folders above the root are checked once per store."""
        if not self._checked:
            try:
                check_ancestors(self.root)
            except StorageError:
                if create:
                    raise
                return nullcontext(None)
            if create:
                make_ancestors(self.root)
            self._checked = create or os.path.lexists(self.root)
        return folders(self.root, validate_name(name), create=create)

    @contextmanager
    def _run(self, name: str) -> Iterator[int]:
        """This run's folder for ``name``, owned (see :meth:`own`), opened for one operation (a
        descriptor kept past it could be closed under another thread and reused)."""
        run_dir = self.own(name)
        with folders(self.root, name, self.run, create=False) as run_fd:
            if run_fd is None:
                raise StorageError(f"{run_dir} vanished while this publisher owns it; do not delete a live run's folder", adapter=name)
            yield run_fd
