"""Filesystem steps the disk store is built from: durable writes, out-of-sight removal, a
non-blocking owner-lock attempt, and the OS error number behind lorasync's wrapped OSErrors."""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
from pathlib import Path
from typing import IO

__all__ = ["errno_of", "fsync_dir", "fsync_file", "remove_version", "try_lock"]


def errno_of(exc: BaseException) -> int | None:
    """The OS error number of ``exc`` or of what it was raised from (lorasync wraps OSErrors)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen.errno
        seen = seen.__cause__
    return None


def remove_version(final: Path) -> bool:
    """Rename out of sight, then delete; False when it was already gone."""
    trash = final.parent / f".trash-{final.name}-{secrets.token_hex(4)}"
    try:
        os.rename(final, trash)
    except FileNotFoundError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def try_lock(path: Path) -> IO[bytes] | None:
    """The lock at ``path`` taken exclusively without waiting, or None when a live owner holds it."""
    try:
        handle = open(path, "ab")  # noqa: SIM115 - closed by the caller
    except OSError:
        return None
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None
    return handle


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
