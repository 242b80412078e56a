"""DiskStore: atomic, versioned adapter directories that belong to one run (one publisher).

Layout: ``<root>/<name>/<run>/v<version>/{adapter_model.safetensors, adapter_config.json,
lorasync.json}``. Every publisher owns one run directory per adapter name, so two jobs on one
host (or a re-run of the same training) never collide on a version and never delete each other's
files; the run is chosen at random by default and can be set (``run=``) to resume one.

Ownership is a lock, not a PID: the live owner holds ``flock(LOCK_EX)`` on ``<run>/.owner.lock``
from its first write until :meth:`DiskStore.close` (the kernel drops it when the process dies, on
any host that shares the filesystem's lock semantics, in any PID namespace). A run whose lock can
be taken has no live owner: :meth:`DiskStore.sweep_orphans` removes its versions except the ones
an engine may still reload (the caller says which).

A version is written into a hidden temp directory inside the run, fsynced, then renamed into
place, so a reader (an engine) sees a complete version or none. A failed write removes its temp
directory at once (a full disk leaves nothing behind). A published version is never rewritten;
removal renames it to a hidden trash name first, so a half-deleted directory is never visible
under a published name.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from lorasync._adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, Adapter
from lorasync._names import validate_name, validate_version
from lorasync.transports._fsutil import errno_of, fsync_dir, fsync_file, remove_version, try_lock
from lorasync.errors import ConfigError, PublishError, StorageError

__all__ = ["DiskStore", "default_root", "new_run_id"]

META = "lorasync.json"
RUN_META = "run.json"
OWNER_LOCK = ".owner.lock"
HOLDERS = ".holders.json"
_HIDDEN = (".tmp-", ".trash-")
# Run directories this process owns (their locks stay open until it exits) and the ones a live
# (not closed) store of this process uses.
_OWNED: dict[Path, IO[bytes]] = {}
_LIVE: set[Path] = set()
_GUARD = threading.Lock()


def default_root() -> Path:
    """``/dev/shm/lorasync`` (tmpfs: memory speed, no disk wear) when writable, else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / "lorasync"
    return Path(tempfile.gettempdir()) / "lorasync"


def new_run_id() -> str:
    """A fresh run identity: UTC time (sortable, readable) plus 48 random bits (unique)."""
    return time.strftime("run-%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(6)


class DiskStore:
    """Versioned adapter directories of one run (see module docstring).

    Args:
        root (`str | os.PathLike`, *optional*): defaults to :func:`default_root`. For engines on
            other hosts use a shared filesystem path they see at the same location.
        run (`str`, *optional*): this store's run identity (a name: letters, digits, ``._-``).
            Default: a fresh :func:`new_run_id`. Pass the same run to resume it after a restart;
            two live stores cannot own one run at once.

    Raises:
        InvalidNameError: ``run`` is not a valid name.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, *, run: str | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.run = validate_name(run) if run is not None else new_run_id()
        self._owner: dict[str, Path] = {}
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
        """The content hash of ``version`` of ``name`` in whichever run recorded ``holder`` (an
        engine id) as holding it — how a restarted publisher recognises what an engine serves.

        In-process engine ids (ending in ``:``) are only matched in runs of this process: another
        process's in-process engine is another engine.
        """
        found = self.content_hash(name, version)
        if found is not None:
            return found
        for run in self.runs(name):
            run_dir = self.root / name / run
            if holder.endswith(":") and run_dir not in _OWNED:
                continue
            record = self.record_of(name, version, run=run)
            if record is not None and holder in record[0]:
                return _recorded_hash(run_dir / f"v{validate_version(version)}")
        return None

    # -- ownership ----------------------------------------------------------------------------

    def own(self, name: str) -> Path:
        """Take (once) the owner lock of this run's directory for ``name``; returns the directory.

        The lock stays with this process until it exits (also after :meth:`close`), so another
        job's sweep never takes a run whose in-process engines may still be serving; a later
        store of this process may take the run over once this one is closed.

        Raises:
            ConfigError: another live store (this process or another) owns the run already.
            StorageError: the directory or lock cannot be created.
        """
        run_dir = self.run_dir(name)
        if name in self._owner:
            return run_dir
        with _GUARD:
            if run_dir in _LIVE:
                raise ConfigError(
                    f"run {self.run!r} of {name!r} under {self.root} is in use by another publisher of this process; "
                    "give each publisher its own run= (or leave run= unset for a fresh one)"
                )
            while run_dir not in _OWNED:
                try:
                    run_dir.mkdir(parents=True, exist_ok=True)
                    handle = open(run_dir / OWNER_LOCK, "ab")  # noqa: SIM115 - held until the process exits
                except OSError as exc:
                    raise StorageError(
                        f"cannot create run directory {run_dir}: {exc}; check the store root's permissions and free space", adapter=name
                    ) from exc
                try:
                    if not _flock_patiently(handle, run_dir / OWNER_LOCK):
                        handle.close()  # a sweep took the empty new run away before we locked it
                        continue
                except BlockingIOError:
                    handle.close()
                    raise ConfigError(
                        f"run {self.run!r} of {name!r} under {self.root} is owned by another live process; "
                        "give each job its own run= (or leave run= unset for a fresh one)"
                    ) from None
                except OSError as exc:
                    handle.close()
                    raise StorageError(f"cannot lock {run_dir / OWNER_LOCK}: {exc}", adapter=name) from exc
                _OWNED[run_dir] = handle
            _LIVE.add(run_dir)
            self._owner[name] = run_dir
        # Leftovers inside the run (a crash, a full disk) are the owner's half-finished work.
        _remove_hidden(run_dir)
        info = {"run": self.run, "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        try:
            (run_dir / RUN_META).write_text(json.dumps(info))
        except OSError:
            pass  # informational only
        return run_dir

    def close(self) -> None:
        """Stop using this run (files stay; the process keeps the run's lock; idempotent)."""
        with _GUARD:
            for run_dir in self._owner.values():
                _LIVE.discard(run_dir)
            self._owner = {}

    def runs(self, name: str) -> list[str]:
        """Every run directory of ``name`` under the root (this run included)."""
        name_dir = self.root / validate_name(name)
        if not name_dir.is_dir():
            return []
        # A directory holding a version's metadata directly is a version of the layout before runs
        # (``<root>/<name>/vN``): not a run, and never swept.
        return sorted(e.name for e in name_dir.iterdir() if e.is_dir() and not e.name.startswith(".") and not (e / META).exists())

    def sweep_orphans(self, name: str, *, keep: Callable[[str, int], bool]) -> list[Path]:
        """Remove versions of runs of ``name`` that no live store owns.

        Args:
            name (`str`): the adapter name.
            keep (`Callable[[str, int], bool]`): ``keep(run, version)`` is True for a version an
                engine may still reload (it stays, and so does its run directory).

        Returns:
            The version directories removed.
        """
        removed: list[Path] = []
        for run in self.runs(name):
            if run == self.run:
                continue
            run_dir = self.root / name / run
            with _GUARD:  # against this process's stores taking a run right now
                if run_dir in _OWNED:
                    continue  # this process's own earlier run: its in-process engines may still serve it
                attempt = try_lock(run_dir / OWNER_LOCK)
            if attempt is None:
                continue  # a live owner
            try:
                _remove_hidden(run_dir)
                left = False
                for version in _versions_in(run_dir):
                    if keep(run, version):
                        left = True
                        continue
                    if remove_version(run_dir / f"v{version}"):
                        removed.append(run_dir / f"v{version}")
                if not left and not _versions_in(run_dir):
                    shutil.rmtree(run_dir, ignore_errors=True)
            finally:
                attempt.close()
        return removed

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

    def write_hashed(self, adapter: Adapter, name: str, version: int) -> tuple[Path, int, str]:
        """:meth:`write`, and the content hash of exactly the bytes written, from the write pass.

        Returns:
            ``(path, bytes_written, content_hash)``; the recorded hash when the identical version
            existed (then nothing is written).

        Raises:
            PublishError, StorageError: as :meth:`write`.
        """
        final = self.path_for(name, version)
        run_dir = self.own(name)
        existing = self.content_hash(name, version)
        if existing is not None:
            if adapter.matches_hash(existing):
                return final, 0, existing
            raise PublishError(
                f"{name} v{version} is already published in run {self.run!r} at {final} with different content; "
                "published versions are immutable: publish under a higher version (or a new run)",
                adapter=name,
                version=version,
            )
        tmp = run_dir / f".tmp-v{version}-{secrets.token_hex(4)}"
        try:
            digest = adapter.save_hashed(tmp)[1]  # the hash of the bytes written, same pass
            (tmp / META).write_text(
                json.dumps({"name": name, "version": version, "run": self.run, "content_hash": digest, "created": time.time()})
            )
            if self.holders_of is not None:
                (tmp / HOLDERS).write_text(json.dumps({"holders": sorted(set(self.holders_of(name, version))), "unloaded_at": None}))
            for fname in (ADAPTER_WEIGHTS, ADAPTER_CONFIG, META):
                fsync_file(tmp / fname)
            fsync_dir(tmp)
            written = sum((tmp / f).stat().st_size for f in (ADAPTER_WEIGHTS, ADAPTER_CONFIG, META))
            os.rename(tmp, final)
            fsync_dir(run_dir)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if errno_of(exc) in (errno.ENOTEMPTY, errno.EEXIST) and final.exists():
                # Only this run's owner writes here, so this is a second writer of the same version
                # inside this publisher; equal content is the same publish.
                if self.content_hash(name, version) == digest:
                    return final, 0, digest
                raise PublishError(
                    f"{name} v{version} was published concurrently with different content in run {self.run!r}; "
                    "publish each version once",
                    adapter=name,
                    version=version,
                ) from exc
            if errno_of(exc) == errno.ENOSPC:
                raise StorageError(
                    f"cannot publish {name} v{version}: the store's filesystem ({self.root}) is full; free space, lower keep=, "
                    "or use a bigger root= (nothing of this version was left behind)",
                    adapter=name,
                    version=version,
                ) from exc
            raise StorageError(f"cannot publish {name} v{version} under {self.root}: {exc}; check free space and permissions", adapter=name, version=version) from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final, written, digest

    def record(self, name: str, version: int, *, holders: Iterable[str], unloaded_at: float | None = None) -> None:
        """Record which engines hold a version of this run, and when the last one let it go (so
        a sweep keeps files an engine may reload, and a later publisher keeps them through the
        grace). Best effort: a failed write is ignored (then nobody known holds the version)."""
        path = self.path_for(name, version)
        if not path.is_dir():
            return
        try:
            # A hidden temp of the run (its next owner removes it), not a stray file in the version.
            tmp = path.parent / f".tmp-holders-{version}-{secrets.token_hex(4)}"
            tmp.write_text(json.dumps({"holders": sorted(set(holders)), "unloaded_at": unloaded_at}))
            os.replace(tmp, path / HOLDERS)
        except OSError:
            pass

    def record_of(self, name: str, version: int, *, run: str | None = None) -> tuple[list[str], float | None] | None:
        """``(holders, unloaded_at)`` recorded for ``version`` of ``name`` in ``run`` (default: this
        run); None when nothing was recorded."""
        run = self.run if run is None else validate_name(run)
        path = self.root / validate_name(name) / run / f"v{validate_version(version)}" / HOLDERS
        try:
            found = json.loads(path.read_text())
            holders = [str(h) for h in found["holders"]]
            unloaded = found.get("unloaded_at")
            return holders, float(unloaded) if unloaded is not None else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def remove(self, name: str, version: int) -> None:
        """Delete a version of this run: first renamed out of sight, then removed.

        Raises:
            StorageError: the rename failed for another reason than the version being gone.
        """
        final = self.path_for(name, version)
        try:
            remove_version(final)
        except OSError as exc:
            raise StorageError(f"cannot remove {final}: {exc}", adapter=name, version=version) from exc


def _versions_in(run_dir: Path) -> list[int]:
    if not run_dir.is_dir():
        return []
    found = []
    for entry in run_dir.iterdir():
        if entry.name.startswith("v") and entry.name[1:].isdigit() and (entry / META).is_file():
            found.append(int(entry.name[1:]))
    return sorted(found)


def _flock_patiently(handle: IO[bytes], path: Path, *, tries: int = 40, pause: float = 0.025) -> bool:
    """Lock ``path`` (a sweep testing for a dead run holds it a moment: retried ~1 s, then
    BlockingIOError); False when a sweep removed the file meanwhile (open it again)."""
    for attempt in range(tries):
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt == tries - 1:
                raise
            time.sleep(pause)
    try:
        return os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return False


def _recorded_hash(path: Path) -> str | None:
    try:
        return str(json.loads((path / META).read_text())["content_hash"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remove_hidden(run_dir: Path) -> None:
    """Temp and trash directories inside a run are only ever its owner's half-finished work."""
    try:
        entries: Iterable[Path] = list(run_dir.iterdir())
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(_HIDDEN):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
