"""DiskStore: atomic, versioned adapter directories under one root.

Layout: ``<root>/<name>/v<version>/{adapter_model.safetensors, adapter_config.json,
lorasync.json}``. A version is written into a hidden temp directory, fsynced, then renamed into
place, so a reader (an engine) sees a complete version or none. A published version is never
rewritten; removal renames it to a hidden trash name first, so a half-deleted directory is never
visible under a published name. Temp and trash left by a crashed publisher are swept on the
next write. ``<root>/.<name>.lock`` coordinates publishers (also across processes): loaders hold
it shared from write to load, collection takes it exclusively (see :meth:`DiskStore.lock`).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import IO

from lorasync._adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, Adapter
from lorasync._names import validate_name, validate_version
from lorasync.errors import PublishError, StorageError

__all__ = ["DiskStore", "default_root"]

META = "lorasync.json"
_HIDDEN = (".tmp-", ".trash-")


def default_root() -> Path:
    """``/dev/shm/lorasync`` (tmpfs: memory speed, no disk wear) when writable, else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / "lorasync"
    return Path(tempfile.gettempdir()) / "lorasync"


class DiskStore:
    """Versioned adapter directories (see module docstring).

    Args:
        root (`str | os.PathLike`, *optional*): defaults to :func:`default_root`. For engines on
            other hosts use a shared filesystem path they see at the same location.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()

    def path_for(self, name: str, version: int) -> Path:
        """Where version ``version`` of ``name`` lives (validated; never escapes ``root``)."""
        return self.root / validate_name(name) / f"v{validate_version(version)}"

    def versions(self, name: str) -> list[int]:
        """Complete published versions of ``name``, ascending."""
        base = self.root / validate_name(name)
        if not base.is_dir():
            return []
        found = []
        for entry in base.iterdir():
            if entry.name.startswith("v") and entry.name[1:].isdigit() and (entry / META).is_file():
                found.append(int(entry.name[1:]))
        return sorted(found)

    def content_hash(self, name: str, version: int) -> str | None:
        """The content hash recorded for a published version, or None if absent."""
        meta = self.path_for(name, version) / META
        try:
            return str(json.loads(meta.read_text())["content_hash"])
        except (OSError, ValueError, KeyError):
            return None

    def write(self, adapter: Adapter, name: str, version: int) -> tuple[Path, int]:
        """Publish ``adapter`` as ``name`` version ``version``; idempotent for equal content.

        Returns:
            ``(path, bytes_written)``; ``bytes_written`` is 0 when the identical version existed.

        Raises:
            PublishError: the version exists with different content (versions are immutable).
            StorageError: the filesystem failed (nothing partial is left visible).
        """
        final = self.path_for(name, version)
        existing = self.content_hash(name, version)
        if existing is not None:
            if adapter.matches_hash(existing):
                return final, 0
            raise PublishError(
                f"{name} v{version} is already published at {final} with different content; published "
                "versions are immutable, publish under a higher version",
                adapter=name,
                version=version,
            )
        parent = final.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self._sweep(parent)
            tmp = parent / f".tmp-v{version}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            digest = adapter.save_hashed(tmp)[1]  # the hash of the bytes written, same pass
            (tmp / META).write_text(
                json.dumps({"name": name, "version": version, "content_hash": digest, "created": time.time()})
            )
            for fname in (ADAPTER_WEIGHTS, ADAPTER_CONFIG, META):
                _fsync_file(tmp / fname)
            _fsync_dir(tmp)
            written = sum((tmp / f).stat().st_size for f in (ADAPTER_WEIGHTS, ADAPTER_CONFIG, META))
            try:
                os.rename(tmp, final)
            except OSError:
                # Someone published the same version concurrently: equal content is fine.
                shutil.rmtree(tmp, ignore_errors=True)
                if self.content_hash(name, version) == digest:
                    return final, 0
                raise
            _fsync_dir(parent)
        except PublishError:
            raise
        except OSError as exc:
            raise StorageError(
                f"cannot publish {name} v{version} under {self.root}: {exc}; check free space and permissions",
                adapter=name,
                version=version,
            ) from exc
        return final, written

    def lock(self, name: str, *, exclusive: bool, blocking: bool = True) -> IO[bytes] | None:
        """Lock ``name``'s versions: shared while a version is written and loaded, exclusive to
        collect old ones. ``flock`` on ``<root>/.<name>.lock``: released by ``close()`` on the
        returned handle, or by the kernel when the process dies.

        Returns:
            The open lock file, or None when ``blocking=False`` and the lock is taken.

        Raises:
            StorageError: the lock file cannot be created.
        """
        path = self.root / f".{validate_name(name)}.lock"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(path, "ab")  # noqa: SIM115 - the caller closes it to unlock
        except OSError as exc:
            raise StorageError(f"cannot create {path}: {exc}; check the store root's permissions", adapter=name) from exc
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB)
        try:
            fcntl.flock(handle.fileno(), mode)
        except BlockingIOError:
            handle.close()
            return None
        except OSError as exc:
            handle.close()
            raise StorageError(f"cannot lock {path}: {exc}", adapter=name) from exc
        return handle

    def remove(self, name: str, version: int) -> None:
        """Delete a version: first renamed out of sight, then removed."""
        final = self.path_for(name, version)
        if not final.exists():
            return
        trash = final.parent / f".trash-v{version}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(final, trash)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StorageError(f"cannot remove {final}: {exc}", adapter=name, version=version) from exc
        shutil.rmtree(trash, ignore_errors=True)

    def _sweep(self, parent: Path) -> None:
        """Remove temp/trash directories whose owning process is gone."""
        for entry in parent.iterdir():
            if not entry.name.startswith(_HIDDEN):
                continue
            parts = entry.name.split("-")
            pid = int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else -1
            if pid != os.getpid() and not _alive(pid):
                shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
