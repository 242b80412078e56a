"""The store is a trust boundary (design invariant 9): the root and everything under it belong to
the current user, nobody else can write (or read) it, nothing in it is followed through a
symlink, and foreign entries are left alone.

The folders of "another user" are real: this suite runs as root, so it chowns them to ``nobody``
(and one test runs a child process as ``nobody`` to see the store from the other side).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lorasync import Publisher
from lorasync.errors import StorageError
from lorasync.testing import MemoryEngine
from lorasync.transports import DiskStore, _store
from tests.support.adapters import tiny_adapter

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown folders to another user")


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _publish(root: Path, *, run: str | None = None, version: int = 1) -> tuple[object, MemoryEngine]:
    engine = MemoryEngine()
    pub = Publisher([engine], name="p", keep=2, root=root, run=run)
    try:
        return pub.publish(tiny_adapter(version), version=version).settled(), engine
    finally:
        pub.close()


def _refused(report: object, *words: str) -> StorageError:
    error = report.results[0].error  # type: ignore[attr-defined]
    assert isinstance(error, StorageError), report
    for word in words:
        assert word in str(error), str(error)
    return error


# -- what the store creates ---------------------------------------------------------------------


def test_everything_the_store_creates_is_private_to_its_user(tmp_path):
    """Suspected in issue 28 and true on main: adapters were 0644 files in 0755 folders, readable
    by every local user. Now every folder is 0700 and every file 0600."""
    root = tmp_path / "store"
    report, _ = _publish(root)
    assert report.ok, report
    seen = 0
    for path in [root, *root.rglob("*")]:
        seen += 1
        want = 0o700 if path.is_dir() else 0o600
        assert _mode(path) == want, f"{path.relative_to(tmp_path)} is {oct(_mode(path))}, want {oct(want)}"
        assert os.lstat(path).st_uid == os.geteuid()
    # root, name, run, v1, the lock, run.json, the three version files and the holders record
    assert seen >= 10


def test_missing_ancestors_of_the_root_are_created_private(tmp_path):
    root = tmp_path / "a" / "b" / "store"
    report, _ = _publish(root)
    assert report.ok, report
    assert _mode(tmp_path / "a") == 0o700 and _mode(tmp_path / "a" / "b") == 0o700


# -- folders the store does not trust ------------------------------------------------------------


@as_root
@pytest.mark.parametrize("where", ["root", "name", "run"])
def test_a_folder_of_another_user_is_refused_and_left_alone(tmp_path, where):
    """Issue 28 item 5: a root (or name or run folder) pre-created by another local user was used
    as is, so that user could swap a version between our rename and the engine's read."""
    root = tmp_path / "store"
    folder = {"root": root, "name": root / "p", "run": root / "p" / "exp42"}[where]
    folder.mkdir(parents=True, mode=0o700)
    os.chown(folder, NOBODY, NOBODY)
    report, engine = _publish(root, run="exp42")
    _refused(report, str(folder), "uid 65534", "root=")
    assert engine.ops.count("load_adapter") == 0
    assert sorted(p.name for p in folder.iterdir()) == []  # nothing written into it


# A sticky root is like /dev/shm: see test_a_sticky_root_works_and_a_squatted_name_in_it_is_refused.
@pytest.mark.parametrize(
    ("where", "mode"),
    [(w, m) for w in ("root", "name", "run") for m in (0o777, 0o770, 0o722, 0o1777) if not (w == "root" and m & 0o1000)],
    ids=lambda v: oct(v) if isinstance(v, int) else v,
)
def test_a_folder_others_can_write_is_refused(tmp_path, where, mode):
    root = tmp_path / "store"
    folder = {"root": root, "name": root / "p", "run": root / "p" / "exp42"}[where]
    folder.mkdir(parents=True, mode=0o700)
    os.chmod(folder, mode)
    report, _ = _publish(root, run="exp42")
    _refused(report, str(folder), "writable", "chmod")
    assert list(folder.iterdir()) == []


def test_a_sticky_root_works_and_a_squatted_name_in_it_is_refused(tmp_path):
    """``root="/dev/shm"`` (or a tmpfs mount point): sticky, so another user may add folders but
    never rename ours. A name folder another user made there first is refused."""
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o1777)
    report, _ = _publish(root)
    assert report.ok, report
    assert _mode(root / "p") == 0o700
    if os.geteuid() == 0:
        (root / "q").mkdir()
        os.chown(root / "q", NOBODY, NOBODY)
        engine = MemoryEngine()
        with Publisher([engine], name="q", root=root) as pub:
            _refused(pub.publish(tiny_adapter(1), version=1), str(root / "q"), "uid 65534")


@pytest.mark.parametrize("where", ["root", "name", "run"])
def test_a_symlinked_folder_is_refused(tmp_path, where):
    root = tmp_path / "store"
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    link = {"root": root, "name": root / "p", "run": root / "p" / "exp42"}[where]
    link.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    link.symlink_to(real)
    report, _ = _publish(root, run="exp42")
    _refused(report, str(link), "symlink")
    assert list(real.iterdir()) == []


@pytest.mark.parametrize("where", ["root", "name", "run"])
def test_a_file_where_a_store_folder_goes_is_refused(tmp_path, where):
    root = tmp_path / "store"
    stray = {"root": root, "name": root / "p", "run": root / "p" / "exp42"}[where]
    stray.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    stray.write_text("not a folder")
    report, _ = _publish(root, run="exp42")
    _refused(report, str(stray), "not a folder")
    assert stray.read_text() == "not a folder"


def test_an_ancestor_others_can_write_is_refused_unless_sticky(tmp_path):
    """Whoever can write the folder holding the root can rename the root away and put their own
    in its place; a sticky folder (``/tmp``, ``/dev/shm``) lets only the owner rename an entry."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    report, _ = _publish(shared / "store")
    _refused(report, str(shared), "writable")
    os.chmod(shared, 0o1777)
    report, _ = _publish(shared / "store2")
    assert report.ok, report


@as_root
def test_an_ancestor_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    report, _ = _publish(theirs / "store")
    _refused(report, str(theirs), "uid 65534")


def test_nothing_read_from_an_untrusted_tree_is_believed(tmp_path):
    """A record planted in a folder others can write never counts (no "unchanged" from it, no
    sweep in it); a transport that needs no files (ipc) still works, a disk write is refused."""
    store = DiskStore(tmp_path / "store", run="mine")
    store.write(tiny_adapter(1), "p", 1)
    store.close()
    os.chmod(tmp_path / "store" / "p", 0o777)
    again = DiskStore(tmp_path / "store", run="mine2")
    assert again.runs("p") == [] and again.record_of("p", 1, run="mine") is None
    assert DiskStore(tmp_path / "store", run="mine").content_hash("p", 1) is None
    assert again.sweep_orphans("p", keep=lambda run, v: False) == []
    with pytest.raises(StorageError, match="writable"):
        again.write(tiny_adapter(2), "p", 2)
    engine = MemoryEngine()
    with Publisher([engine], name="p", root=tmp_path / "store", transport="ipc") as pub:
        assert pub.publish(tiny_adapter(3), version=3).settled().ok
    assert sorted(p.name for p in (tmp_path / "store" / "p").iterdir()) == ["mine"]


# -- the default root: one per user --------------------------------------------------------------


@pytest.fixture
def shm(monkeypatch):
    """A stand-in for /dev/shm that default_root() uses: sticky and world-writable like it, and
    made inside it (or the temp dir) so another user can reach it (pytest's tmp_path is 0700)."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="lorasync-test-shm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        os.chmod(base, 0o1777)
        monkeypatch.setattr(_store, "_SHM", base)
        yield base
    finally:
        shutil.rmtree(base)


@as_root
def test_the_default_root_is_per_user_so_a_second_user_still_works(shm):
    """Issue 28 item 5 with the default root: another user made /dev/shm/lorasync first (world
    writable, as a shared folder would be). This user's default root is its own folder beside it;
    the other user's folder is neither used nor touched."""
    other = shm / "lorasync"
    (other / "p").mkdir(parents=True)
    os.chown(other, NOBODY, NOBODY)
    os.chmod(other, 0o777)
    assert _store.default_root() == shm / f"lorasync-{os.geteuid()}"
    engine = MemoryEngine()
    with Publisher([engine], name="p", keep=2) as pub:
        assert pub.publish(tiny_adapter(1), version=1).settled().ok
        assert Path(engine.path_of("p@v1")).is_relative_to(shm / f"lorasync-{os.geteuid()}")
    assert sorted(p.name for p in other.rglob("*")) == ["p"]


@as_root
def test_a_squatted_default_root_is_refused_with_what_to_do(shm):
    squat = shm / f"lorasync-{os.geteuid()}"
    squat.mkdir()
    os.chown(squat, NOBODY, NOBODY)
    engine = MemoryEngine()
    with Publisher([engine], name="p") as pub:
        error = _refused(pub.publish(tiny_adapter(1), version=1), str(squat), "uid 65534", "root=")
    assert "remove it" in str(error)
    assert list(squat.iterdir()) == []


@as_root
def test_another_user_can_neither_read_nor_replace_what_the_store_wrote(shm):
    """Seen from the other side: a process running as ``nobody`` (uid 65534) next to this user's
    store. It cannot read the adapter bytes, cannot swap a version, and its own default root is
    its own folder, which works."""
    import json

    with Publisher([MemoryEngine()], name="p", keep=2) as pub:
        assert pub.publish(tiny_adapter(1), version=1).settled().ok
        version = pub.store.path_for("p", 1)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the other user
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            seen: dict[str, object] = {}
            for what, attempt in {
                "read": lambda: (version / "adapter_model.safetensors").read_bytes(),
                "list": lambda: os.listdir(version.parent),
                "rename": lambda: os.rename(version, version.parent / "v9"),
                "write": lambda: (version.parent.parent / "planted").mkdir(),
            }.items():
                try:
                    attempt()
                    seen[what] = "allowed"
                except PermissionError:
                    seen[what] = "denied"
            engine = MemoryEngine()
            with Publisher([engine], name="p", keep=2) as theirs:
                seen["own publish"] = theirs.publish(tiny_adapter(2), version=1).settled().ok
                seen["own root"] = str(Path(engine.path_of("p@v1")).parents[2])
            os.write(wfd, json.dumps(seen).encode())
            code = 0
        except BaseException:
            import traceback

            os.write(wfd, traceback.format_exc().encode())
        finally:
            os._exit(code)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as answer:
        said = answer.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, said
    seen = json.loads(said)
    assert seen == {
        "read": "denied",
        "list": "denied",
        "rename": "denied",
        "write": "denied",
        "own publish": True,
        "own root": str(shm / f"lorasync-{NOBODY}"),
    }
