"""Filesystem steps the disk store is built from: folders opened one component at a time without
following a symlink, private files written whole, out-of-sight removal, a non-blocking
owner-lock attempt, and the OS error number behind lorasync's wrapped OSErrors.

Everything below a trusted folder goes through descriptors (``dir_fd``) opened with
``O_NOFOLLOW``: a symlink put anywhere in the store is an entry like any other, never a way out
of it. Files and folders are created ``0600`` / ``0700``.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "DIR_FLAGS",
    "errno_of",
    "is_version_name",
    "listdir_at",
    "open_dir",
    "opened",
    "read_at",
    "remove_tree_at",
    "remove_version",
    "try_lock",
    "write_private",
]

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_VERSION = re.compile(r"v(?:0|[1-9][0-9]{0,14})", re.ASCII)  # what served_name() writes


def errno_of(exc: BaseException) -> int | None:
    """The OS error number of ``exc`` or of what it was raised from (lorasync wraps OSErrors)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen.errno
        seen = seen.__cause__
    return None


def is_version_name(name: str) -> bool:
    """``v<N>`` exactly as the store writes it (ASCII digits, no leading zero): ``v03``, ``v²``
    or ``v3 (copy)`` are someone else's folders."""
    return _VERSION.fullmatch(name) is not None


def open_dir(base: Path | str, *parts: str, dir_fd: int | None = None) -> int:
    """A descriptor of folder ``base/parts...``; no part (nor ``base`` itself) is followed
    through a symlink: ``ELOOP``/``ENOTDIR`` instead. ``base`` is relative to ``dir_fd`` when
    given. The caller closes it."""
    fd = os.open(base, DIR_FLAGS, dir_fd=dir_fd)
    try:
        for part in parts:
            inner = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def opened(base: Path | str, *parts: str, dir_fd: int | None = None) -> Iterator[int]:
    """:func:`open_dir` as a context manager."""
    fd = open_dir(base, *parts, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def read_at(dir_fd: int, name: str, *, limit: int = 1 << 20) -> bytes:
    """The bytes of regular file ``name`` in ``dir_fd`` (not followed through a symlink; at most
    ``limit`` bytes: the store's records are small)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(f"{name} is not a regular file")
        return os.read(fd, limit)
    finally:
        os.close(fd)


def write_private(dir_fd: int, name: str, data: bytes, *, exclusive: bool = False) -> None:
    """Write ``name`` in ``dir_fd`` as a whole ``0600`` file: into a hidden temp first, then
    renamed over ``name`` (a symlink there is replaced, never written through). ``exclusive``:
    ``name`` is new in a folder nobody else writes (created in place, no temp)."""
    target = name if exclusive else f".tmp-{name}-{secrets.token_hex(4)}"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(data)
    except BaseException:
        os.close(fd)
        os.unlink(target, dir_fd=dir_fd)
        raise
    os.close(fd)
    if not exclusive:
        try:
            os.replace(target, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            os.unlink(target, dir_fd=dir_fd)
            raise


def listdir_at(dir_fd: int) -> Iterator[os.DirEntry[str]]:
    """The entries of ``dir_fd`` (``DirEntry.is_dir(follow_symlinks=False)`` tells real folders)."""
    with os.scandir(dir_fd) as it:  # scandir works on a duplicate: dir_fd stays open
        yield from it


def remove_tree_at(dir_fd: int, name: str) -> None:
    """Remove entry ``name`` of ``dir_fd``: a real folder with everything in it (links inside are
    unlinked, never followed: ``shutil.rmtree`` with ``dir_fd`` works on descriptors), anything
    else (a file, a symlink) unlinked. Already gone is fine."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)
    else:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass


def remove_version(run_fd: int, name: str) -> bool:
    """Rename version folder ``name`` of the run ``run_fd`` out of sight, then delete it; False
    when it was already gone (or is not a real folder: then it is left alone)."""
    try:
        if not stat.S_ISDIR(os.stat(name, dir_fd=run_fd, follow_symlinks=False).st_mode):
            return False
    except FileNotFoundError:
        return False
    trash = f".trash-{name}-{secrets.token_hex(4)}"
    try:
        os.rename(name, trash, src_dir_fd=run_fd, dst_dir_fd=run_fd)
    except FileNotFoundError:
        return False
    shutil.rmtree(trash, dir_fd=run_fd, ignore_errors=True)
    return True


def try_lock(dir_fd: int, name: str) -> int | None:
    """The lock file ``name`` in ``dir_fd`` taken exclusively without waiting (a descriptor the
    caller closes), or None when a live owner holds it, or it is missing or not a regular file
    (then it is no lock of a run)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd
