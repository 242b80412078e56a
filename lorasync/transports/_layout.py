"""The on-disk layout of the store's runs, read and changed without following a symlink: which
entries are runs and versions (everything else is foreign and left alone), their records, the
owner lock, and the removal of a dead run's leftovers. :class:`~lorasync.transports.DiskStore`
is built on it; the rules for trusting a folder are :mod:`lorasync.transports._trust`'s.

A run is a real folder of the current user, named like a run, writable by no one else, holding a
plain ``.owner.lock`` and no ``run.json`` of another run (a copy of a run is not that run). A
version is a real folder ``v<N>`` (exactly as the store writes it) holding a plain
``lorasync.json``.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import stat
import time
from collections.abc import Callable, Container
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from lorasync.adapter._adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from lorasync.adapter._names import validate_name
from lorasync.errors import ConfigError, InvalidNameError, StorageError
from lorasync.transports._fsutil import is_version_name, listdir_at, open_dir, opened, read_at, remove_tree_at, remove_version, try_lock, write_private
from lorasync.transports._trust import check_folder, describe_open_error, folders, make_folder

__all__ = [
    "begin_run",
    "end_run_at",
    "HIDDEN",
    "HOLDERS",
    "META",
    "OWNER_LOCK",
    "RUN_META",
    "flock_patiently",
    "open_lock",
    "open_run",
    "parse_record",
    "read_in_run",
    "read_version_file",
    "recorded_hash",
    "remove_hidden",
    "retire_run",
    "runs_at",
    "put_holders",
    "seal_version",
    "sweep_dead_runs",
    "sweep_run",
    "take_run",
    "versions_at",
    "versions_in",
]

META = "lorasync.json"
RUN_META = "run.json"
OWNER_LOCK = ".owner.lock"
HOLDERS = ".holders.json"
HIDDEN = (".tmp-", ".trash-")


def take_run(name_fd: int, run: str, run_dir: Path, name: str, *, locked: bool) -> tuple[int, int | None]:
    """Create (``0700``), check and lock run ``run`` in the name's folder ``name_fd``.

    Returns:
        ``(the run's descriptor, its lock's descriptor)``; no lock when ``locked`` (this process
        holds it already).

    Raises:
        ConfigError: another live process owns the run.
        StorageError: the run cannot be created or locked, or is not the current user's alone.
    """
    what = f"run {run!r} of {name!r}"
    while True:
        make_folder(run, name_fd, run_dir, what)
        try:
            run_fd = open_dir(run, dir_fd=name_fd)
        except OSError as exc:
            raise describe_open_error(exc, run_dir, what) from exc
        try:
            check_folder(os.fstat(run_fd), run_dir, what)
            if locked:
                return run_fd, None
            lock = open_lock(run_fd, run_dir, name)
            try:
                if flock_patiently(lock, name_fd, run, run_fd):
                    return run_fd, lock
            except BlockingIOError:
                os.close(lock)
                raise ConfigError(
                    f"run {run!r} of {name!r} under {run_dir.parent.parent} is owned by another live process; "
                    "give each job its own run= (or leave run= unset for a fresh one)"
                ) from None
            except OSError as exc:
                os.close(lock)
                raise StorageError(f"cannot lock {run_dir / OWNER_LOCK}: {exc}", adapter=name) from exc
            os.close(lock)  # a sweep took the empty new run away before we locked it: again
        except BaseException:
            os.close(run_fd)
            raise
        os.close(run_fd)


def begin_run(run_fd: int, run: str) -> None:
    """A run just taken (closes ``run_fd``): clear its temp entries (its owner's half-finished
    work: a crash, a full disk) and say who owns it in ``run.json`` (informational, best effort)."""
    try:
        remove_hidden(run_fd)
        info = {"run": run, "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        write_private(run_fd, RUN_META, json.dumps(info).encode())
    except OSError:
        pass  # a run without it is still a run
    finally:
        os.close(run_fd)


def sweep_dead_runs(
    name_fd: int, name_dir: Path, *, mine: str, guard: AbstractContextManager[Any], owned: Container[Path], keep: Callable[[str, int], bool]
) -> list[Path]:
    """Sweep every run of the name's folder ``name_fd`` (at ``name_dir``) but ``mine`` and those
    in ``owned`` whose lock can be taken (no live owner), each under ``guard`` while its lock is
    tried (see :func:`sweep_run`). Returns the version folders removed."""
    removed: list[Path] = []
    for run in runs_at(name_fd):
        run_dir = name_dir / run
        if run == mine:
            continue
        with guard:
            if run_dir in owned:
                continue
            run_fd = open_run(name_fd, run)
            attempt = None if run_fd is None else try_lock(run_fd, OWNER_LOCK)
        if run_fd is None:
            continue
        try:
            if attempt is not None:  # else a live owner
                removed += [run_dir / f"v{v}" for v in sweep_run(name_fd, run, run_fd, keep=lambda v, run=run: keep(run, v))]
        finally:
            if attempt is not None:
                os.close(attempt)
            os.close(run_fd)
    return removed


def sweep_run(name_fd: int, run: str, run_fd: int, *, keep: Callable[[int], bool]) -> list[int]:
    """Remove what a dead run (locked by the caller) leaves: its temp entries and the versions
    not kept (``keep(version)``), then the run itself once nothing of it is left. Foreign entries
    in it stay, and so does the run then. Returns the versions removed."""
    remove_hidden(run_fd)
    removed, left = [], False
    for version in versions_at(run_fd):
        if keep(version):
            left = True
        elif remove_version(run_fd, f"v{version}"):
            removed.append(version)
    if not left:
        retire_run(name_fd, run, run_fd)
    return removed


def open_lock(run_fd: int, run_dir: Path, name: str) -> int:
    """The run's owner lock file (created ``0600``), opened without following a link.

    Raises:
        StorageError: it cannot be opened, or it is not a plain file of the current user.
    """
    try:
        lock = os.open(OWNER_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600, dir_fd=run_fd)
    except OSError as exc:
        raise StorageError(
            f"cannot open the owner lock {run_dir / OWNER_LOCK}: {exc}; remove it if it is not a plain file of yours", adapter=name
        ) from exc
    st = os.fstat(lock)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(lock)
        raise StorageError(f"the owner lock {run_dir / OWNER_LOCK} is not a plain file of yours; remove it", adapter=name)
    return lock


def flock_patiently(lock: int, name_fd: int, run: str, run_fd: int, *, tries: int = 40, pause: float = 0.025) -> bool:
    """Lock the run (a sweep testing for a dead run holds it a moment: retried ~1 s, then
    BlockingIOError); False when a sweep removed the lock or the run meanwhile (start again)."""
    for attempt in range(tries):
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt == tries - 1:
                raise
            time.sleep(pause)
    try:
        same_run = os.stat(run, dir_fd=name_fd, follow_symlinks=False).st_ino == os.fstat(run_fd).st_ino
        return same_run and os.stat(OWNER_LOCK, dir_fd=run_fd, follow_symlinks=False).st_ino == os.fstat(lock).st_ino
    except FileNotFoundError:
        return False


def seal_version(run_fd: int, tmp: str, meta: dict[str, Any], holders: list[str] | None) -> int:
    """Finish the new version in temp folder ``tmp`` of the run (the adapter's files are in it):
    write its metadata (and holders record, when given), make every file private (``0600``)
    and durable. Returns the bytes of the version's three files."""
    with opened(tmp, dir_fd=run_fd) as tmp_fd:
        write_private(tmp_fd, META, json.dumps(meta).encode(), exclusive=True)
        if holders is not None:
            write_private(tmp_fd, HOLDERS, json.dumps({"holders": holders, "unloaded_at": None}).encode(), exclusive=True)
        written = 0
        for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG, META):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=tmp_fd)
            try:
                os.fchmod(fd, 0o600)
                os.fsync(fd)
                written += os.fstat(fd).st_size
            finally:
                os.close(fd)
        os.fsync(tmp_fd)
    return written


def put_holders(run_fd: int, version: int, holders: list[str], unloaded_at: float | None) -> None:
    """Replace the holders record of version ``version`` of the run, staged as a hidden temp of
    the run (its next owner removes it), never a stray file in the version."""
    tmp = f".tmp-holders-{version}-{secrets.token_hex(4)}"
    write_private(run_fd, tmp, json.dumps({"holders": holders, "unloaded_at": unloaded_at}).encode(), exclusive=True)
    try:
        with opened(f"v{version}", dir_fd=run_fd) as version_fd:
            os.replace(tmp, HOLDERS, src_dir_fd=run_fd, dst_dir_fd=version_fd)
    except BaseException:
        remove_tree_at(run_fd, tmp)
        raise


def open_run(name_fd: int, run: str) -> int | None:
    """A descriptor of ``run`` if it is a run of this user (see :meth:`DiskStore.runs`), else None."""
    try:
        validate_name(run)
        fd = open_dir(run, dir_fd=name_fd)
    except (InvalidNameError, OSError):
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise OSError("another user's")
        if not stat.S_ISREG(os.stat(OWNER_LOCK, dir_fd=fd, follow_symlinks=False).st_mode):
            raise OSError("no lock")
        try:
            info = parse_record(read_at(fd, RUN_META))
        except FileNotFoundError:
            info = {"run": run}  # the owner died before writing it
        if not isinstance(info, dict) or info.get("run") != run:
            raise OSError("a copy of another run")
    except (OSError, ValueError):
        os.close(fd)
        return None
    return fd


def runs_at(name_fd: int) -> list[str]:
    found = []
    for entry in listdir_at(name_fd):
        if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
            continue
        fd = open_run(name_fd, entry.name)
        if fd is not None:
            os.close(fd)
            found.append(entry.name)
    return sorted(found)


def versions_at(run_fd: int) -> list[int]:
    found = []
    for entry in listdir_at(run_fd):
        if not is_version_name(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if stat.S_ISREG(os.stat(f"{entry.name}/{META}", dir_fd=run_fd, follow_symlinks=False).st_mode):
                found.append(int(entry.name[1:]))
        except OSError:
            continue
    return sorted(found)


def versions_in(run_dir: Path) -> list[int]:
    """Complete versions of the run at ``run_dir`` (``<root>/<name>/<run>``)."""
    with folders(run_dir.parent.parent, run_dir.parent.name, run_dir.name) as run_fd:
        return [] if run_fd is None else versions_at(run_fd)


def read_version_file(version_dir: Path, file: str) -> Any:
    """The JSON in ``file`` of the version at ``version_dir`` (``<root>/<name>/<run>/v<N>``), or
    None when it is absent, unreadable or no real file of a real version folder."""
    run_dir = version_dir.parent
    with folders(run_dir.parent.parent, run_dir.parent.name, run_dir.name) as run_fd:
        return None if run_fd is None else read_in_run(run_fd, version_dir.name, file)


def read_in_run(run_fd: int, version: str, file: str) -> Any:
    """:func:`read_version_file` for version folder ``version`` of the run open at ``run_fd``."""
    try:
        with opened(version, dir_fd=run_fd) as version_fd:
            return parse_record(read_at(version_fd, file))
    except OSError:
        return None


def parse_record(raw: bytes) -> Any:
    """The JSON in ``raw`` (a record read from the store, already bounded in size by
    :func:`read_at`); None when it is not JSON lorasync can read. Anyone who can write under the
    root can leave such a file, so it is foreign, never an error: JSON nested deeper than the
    parser's stack raises RecursionError, not ValueError, and once failed every publish."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def recorded_hash(path: Path | tuple[int, str]) -> str | None:
    """The content hash in a version's ``lorasync.json``: the version at ``path``, or folder
    ``name`` of the run open at ``run_fd`` for ``(run_fd, name)``; None when there is none."""
    found = read_in_run(*path, META) if isinstance(path, tuple) else read_version_file(path, META)
    try:
        return str(found["content_hash"])
    except (KeyError, TypeError):
        return None


def remove_hidden(run_fd: int) -> None:
    """Temp and trash entries inside a run are only ever its owner's half-finished work (a link
    among them is unlinked, never followed)."""
    try:
        names = [e.name for e in listdir_at(run_fd) if e.name.startswith(HIDDEN)]
    except OSError:
        return
    for name in names:
        remove_tree_at(run_fd, name)


def retire_run(name_fd: int, run: str, run_fd: int) -> None:
    """Remove a dead run left without versions, unless foreign entries are in it (they stay, and
    so does the run)."""
    try:
        left = {e.name for e in listdir_at(run_fd)}
        if not left <= {OWNER_LOCK, RUN_META}:
            return
        for name in (RUN_META, OWNER_LOCK):
            if name in left:
                os.unlink(name, dir_fd=run_fd)
        os.rmdir(run, dir_fd=name_fd)
    except OSError:
        pass


def end_run_at(name_fd: int, run: str) -> bool:
    """Remove the owner's own run ``run`` once no version is left in it (its owner gives it up
    for good); True when it is gone (or was), False when versions or foreign entries are left."""
    run_fd = open_run(name_fd, run)
    if run_fd is None:
        return run not in runs_at(name_fd)
    try:
        if versions_at(run_fd):
            return False
        remove_hidden(run_fd)
        retire_run(name_fd, run, run_fd)  # leaves a run holding foreign entries
    finally:
        os.close(run_fd)
    return run not in runs_at(name_fd)
