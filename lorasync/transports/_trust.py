"""When the disk store trusts a folder (design invariant 9).

An engine reads a version by its path, after lorasync renamed it into place: whoever can rename
or replace any folder on that path can make the engine serve other bytes than the report says.
So:

* the folder of each name and each run must belong to the current user, be writable by no one
  else, and be no symlink (lorasync creates them ``0700``);
* the root and every folder above it must belong to the current user or to root, and be
  writable by no one else unless it is sticky (``/tmp``, ``/dev/shm``: there only an entry's
  owner, or the folder's, may rename it, so another user can squat a name, which is refused, but
  never replace ours). A folder writable by the user's own private group (the umask 002
  distributions) counts as the user's. The root is no symlink.

Whatever fails these rules is refused with a :class:`~lorasync.errors.StorageError` that says
what to do. :func:`folders` opens the store's folders by these rules.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lorasync.errors import ConfigError, StorageError
from lorasync.transports._fsutil import open_dir

__all__ = ["check_ancestors", "check_folder", "check_root", "describe_open_error", "folders", "make_ancestors", "make_folder", "root_path"]

_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_CHECKED: set[str] = set()  # parents of roots whose folders above passed check_ancestors


def check_folder(st: os.stat_result, path: Path, what: str) -> None:
    """Refuse a name's or a run's folder that is not the current user's alone.

    Args:
        st: its ``fstat``/``lstat`` result.
        path: shown in the message.
        what: what it is, e.g. ``"run 'exp42' of 'policy'"``.

    Raises:
        StorageError: not a folder, another user's, or writable by group or others.
    """
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise StorageError(f"{what} {path} is not a folder; remove it or pass root= another folder")
    if st.st_uid != me:
        raise StorageError(
            f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {me}): another user made it, so nothing in it can be "
            f"trusted (they could swap a version before the engine reads it); remove it (as that user or root) or pass root= a "
            "folder of your own"
        )
    if st.st_mode & _OTHERS:
        who = " and ".join(w for w, bit in (("its group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit)
        raise StorageError(
            f"{what} {path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}): anyone who can write it can swap a "
            f"version before the engine reads it; run `chmod go-w {path}` (lorasync makes its folders 0700) or pass root= "
            "another folder"
        )


def check_root(st: os.stat_result, root: Path) -> None:
    """Refuse a store root that someone else may rename things in (see module docstring).

    Raises:
        StorageError: not a folder, or another user may write or replace what is in it.
    """
    if not stat.S_ISDIR(st.st_mode):
        raise StorageError(f"the store root {root} is not a folder; remove it or pass root= another folder")
    problem = _shared_problem(st)
    if problem is not None:
        raise StorageError(f"the store root {root} {problem}")


def check_ancestors(root: Path) -> None:
    """Refuse a root below a folder someone else may rename things in (see module docstring).
    Both the path as given and its real path (symlinks resolved) are checked, up to ``/``; a
    parent that passed is not checked again in this process (every stateless call makes a store).

    Raises:
        StorageError: an ancestor that another user owns or may write.
    """
    parent = os.path.dirname(str(root))
    if parent in _CHECKED:
        return
    seen: set[str] = set()
    for start in (parent, os.path.realpath(parent)):
        folder = start
        while folder not in seen:
            seen.add(folder)
            try:
                st = os.lstat(folder)
            except FileNotFoundError:
                st = None  # made by make_ancestors (0700) before use
            except OSError as exc:
                raise StorageError(f"cannot check the folders above the store root {root} ({folder}: {exc}); pass root= another folder") from exc
            if st is not None:
                problem = None if stat.S_ISLNK(st.st_mode) and st.st_uid in (0, os.geteuid()) else _shared_problem(st)
                if problem is not None:
                    raise StorageError(f"{folder}, a folder above the store root {root}, {problem}")
            folder = os.path.dirname(folder)
    _CHECKED.add(parent)


def _shared_problem(st: os.stat_result) -> str | None:
    """What is wrong with the root or a folder above it (None: nothing)."""
    me = os.geteuid()
    if st.st_uid not in (0, me):
        return (
            f"belongs to uid {st.st_uid}, not to you (uid {me}) or root: another user made it and could replace what is in it "
            "(a version, before the engine reads it); remove it (as that user or root) or pass root= a folder of your own"
        )
    if not st.st_mode & _OTHERS or st.st_mode & stat.S_ISVTX:
        return None
    if not st.st_mode & stat.S_IWOTH and _private_group(st.st_gid, me):
        return None
    who = " and ".join(w for w, bit in (("its group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit)
    return (
        f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}, not sticky): anyone who can write it can replace what is in "
        "it (a version, before the engine reads it); run `chmod go-w` on it (or `chmod +t` for a shared folder like /tmp) or "
        "pass root= another folder"
    )


def make_ancestors(root: Path) -> None:
    """Create the missing folders above ``root``, each ``0700``."""
    missing = []
    for folder in root.parents:
        if os.path.lexists(folder):
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise StorageError(f"cannot create {folder} for the store root {root}: {exc}; check its permissions or pass root= another folder") from exc


def make_folder(step: str, dir_fd: int | None, where: Path, what: str) -> None:
    """Create folder ``step`` (relative to ``dir_fd``) ``0700`` unless it exists.

    Raises:
        StorageError: it cannot be created (``where`` and ``what`` name it in the message).
    """
    try:
        os.mkdir(step, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StorageError(f"cannot create {what} {where}: {exc}; check its permissions and free space, or pass root= another folder") from exc


def describe_open_error(exc: OSError, path: Path, what: str) -> StorageError:
    """The typed error for a store folder that could not be opened without following a link."""
    if os.path.islink(path):
        return StorageError(
            f"{what} {path} is a symlink (to {os.readlink(path)}): the store follows no symlink; replace the link by a folder "
            "or pass root= the real folder"
        )
    if os.path.lexists(path) and not os.path.isdir(path):
        return StorageError(f"{what} {path} is not a folder; remove it or pass root= another folder")
    return StorageError(f"cannot open {what} {path}: {exc}; check its permissions and free space, or pass root= another folder")


def _private_group(gid: int, uid: int) -> bool:
    """The user's own group (a "user private group": the primary group, with no other member)."""
    if gid == 0:
        return False  # group root: the primary group of arbitrary uids in some containers
    try:
        user = pwd.getpwuid(uid)
        members = set(grp.getgrgid(gid).gr_mem)
    except KeyError:
        return False
    return user.pw_gid == gid and members <= {user.pw_name}


@contextmanager
def folders(root: Path, *parts: str, create: bool = False) -> Iterator[int | None]:
    """A descriptor of ``<root>/<name>[/<run>]`` (``parts``), every folder checked and none
    followed through a symlink, created ``0700`` with ``create``. None when one does not exist
    or, without ``create`` (a read), is not to be trusted: nothing in it is believed.

    Raises:
        StorageError: with ``create``, a folder that is not the current user's alone, a symlink,
            or one that cannot be made.
    """
    try:
        fd = _open_checked(root, parts, create=create)
    except StorageError:
        if create:
            raise
        fd = None
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def _open_checked(root: Path, parts: tuple[str, ...], *, create: bool) -> int | None:
    whats = ["the store root", f"the store folder of {parts[0]!r}" if parts else "", f"run {parts[-1]!r} of {parts[0]!r}"]
    fd = None
    where = root
    try:
        for depth, part in enumerate(("", *parts)):
            where, what = (where / part if part else where), whats[depth]
            step = str(where) if fd is None else part
            if create:
                make_folder(step, fd, where, what)
            try:
                inner = open_dir(step, dir_fd=fd)
            except FileNotFoundError:
                if create:
                    raise StorageError(f"{what} {where} vanished while it was created; try again") from None
                if fd is not None:
                    os.close(fd)
                return None
            except OSError as exc:
                raise describe_open_error(exc, where, what) from exc
            if fd is not None:
                os.close(fd)
            fd = inner
            if depth:
                check_folder(os.fstat(fd), where, what)
            else:
                check_root(os.fstat(fd), where)
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    return fd


def root_path(root: object) -> str:
    """``root`` as a path string: a path-like that names a folder (``""`` would be the working
    directory, which is no store).

    Raises:
        ConfigError: anything else.
    """
    try:
        text = os.fspath(root)  # type: ignore[call-overload]
    except TypeError:
        raise ConfigError(f"root must be a folder path (str or os.PathLike), got {root!r} ({type(root).__name__})") from None
    if not text or (isinstance(text, str) and not text.strip()):
        raise ConfigError("root is empty; pass a folder for the store (or leave root=None for the per-user default)")
    return text  # type: ignore[no-any-return]
