"""The store as trainers and careless users meet it (issue 28 items 14, 16, 17, 18 and the fork
suspicion): symlinks and foreign entries in the root, concurrent stateless calls, and a forked
data-loader worker outliving the trainer."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from lorasync import Publisher, apublish_adapter, publish_adapter
from lorasync.errors import ConfigError
from lorasync.testing import MemoryEngine
from lorasync.transports import DiskStore
from tests.support.adapters import tiny_adapter

from ._figures import record

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")


def _tree(path: Path) -> dict[str, str]:
    """Every entry under ``path`` (not followed through links) with its content's digest."""
    found = {}
    for entry in sorted(path.rglob("*")):
        rel = str(entry.relative_to(path))
        if entry.is_symlink():
            found[rel] = "-> " + os.readlink(entry)
        elif entry.is_file():
            found[rel] = hashlib.sha256(entry.read_bytes()).hexdigest()
        else:
            found[rel] = "dir"
    return found


def _dead_job(root: Path, *, name: str = "p", versions: int = 2, run: str | None = None) -> str:
    """A job that published ``versions`` versions and was SIGKILLed; returns its run."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the dead job
        try:
            pub = Publisher([MemoryEngine()], name=name, keep=versions, root=root, run=run)
            for v in range(1, versions + 1):
                pub.publish(tiny_adapter(v), version=v).settled()
            os.write(wfd, pub.run.encode())
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(1)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as said:
        dead = said.read().decode()
    os.waitpid(pid, 0)
    assert dead, "the dead job did not publish"
    return dead


# -- item 14: the orphan sweep follows nothing -------------------------------------------------


def test_the_orphan_sweep_never_deletes_through_a_symlink(tmp_path):
    """Item 14: a user keeps a good run on persistent disk and links it into the store to serve
    it again (``ln -s /data/keep/run-x <root>/p/run-x``). The next job's orphan sweep took the
    link for a dead run and deleted the versions on /data. Also links inside a dead run (a
    version, a temp entry, its lock) must not take the sweep outside the root."""
    root, keep = tmp_path / "store", tmp_path / "data" / "keep"
    _dead_job(keep, run="run-x")  # the saved run's job is long gone
    outside = tmp_path / "data" / "outside"
    (outside / "v7").mkdir(parents=True)
    (outside / "v7" / "lorasync.json").write_text("{}")
    (outside / ".tmp-v7-dead").mkdir()
    (outside / "notes.txt").write_text("mine")
    dead = _dead_job(root)
    (root / "p" / "run-x").symlink_to(keep / "p" / "run-x")  # the linked-in saved run
    (root / "p" / dead / "v7").symlink_to(outside / "v7")  # links inside a dead run
    (root / "p" / dead / ".tmp-v8-x").symlink_to(outside / ".tmp-v7-dead")
    (root / "p" / dead / "v9").symlink_to(outside)
    before_keep, before_outside = _tree(keep), _tree(outside)

    engine = MemoryEngine()
    with Publisher([engine], name="p", keep=2, root=root) as pub:
        for v in (1, 2, 3):
            assert pub.publish(tiny_adapter(10 + v), version=v).settled().ok
    touched = sum(a != b for a, b in ((_tree(keep), before_keep), (_tree(outside), before_outside)))
    record(store_symlinks=4, store_symlinks_followed=touched)
    assert _tree(keep) == before_keep, "the sweep deleted files outside the root"
    assert _tree(outside) == before_outside, "the sweep deleted files outside the root"
    # The dead job's own versions (real folders inside the root) were still swept.
    assert not (root / "p" / dead / "v1").exists() and not (root / "p" / dead / "v2").exists()


# -- item 16: foreign entries are never a reason to fail ----------------------------------------


def _foreign(root: Path, live_run: str) -> None:
    """What users and tools leave in a store: copies, stray files, odd names."""
    base = root / "p"
    shutil.copytree(base / live_run, base / "run-old (copy)", symlinks=True)  # a file manager's copy
    shutil.copytree(base / live_run, base / "run-old-backup", symlinks=True)  # a copy under a valid name
    (base / "README.txt").write_text("do not delete")
    (base / "v3").mkdir()  # a version folder where runs go
    (base / "run-empty").mkdir()  # a folder that is no run
    for odd in ("v²", "v03", "v3 (copy)", "v-1", ".v2"):
        (base / live_run / odd).mkdir()
    (base / live_run / "notes.md").write_text("mine")


def test_foreign_entries_are_ignored_never_parsed_never_deleted(tmp_path):
    """Item 16: a stray folder such as ``run-old (copy)`` under ``<root>/<name>/`` made every
    publish fail with InvalidNameError; other foreign entries were parsed as runs or versions
    (``v²`` crashed the listing) or deleted by the sweep as a dead run."""
    root = tmp_path / "store"
    dead = _dead_job(root, run="run-old")
    _foreign(root, dead)
    before = _tree(root / "p")
    engine = MemoryEngine()
    with Publisher([engine], name="p", keep=2, root=root) as pub:
        for v in range(1, 5):
            report = pub.publish(tiny_adapter(20 + v), version=v).settled()
            assert report.ok, report
        assert pub.store.versions("p") == [3, 4]
    # A restarted trainer (the stateless call reads what the engine serves, then the records).
    report = publish_adapter(tiny_adapter(24), engine, name="p", version=4, root=root)
    assert report.ok, report
    after = _tree(root / "p")
    gone = sorted(set(before) - set(after))
    changed = sorted(p for p in before if p in after and after[p] != before[p])
    # Only the dead run's real versions went; every foreign entry stayed (so the dead run did too).
    foreign = ("run-old (copy)", "run-old-backup", "README.txt", "v3", "run-empty", f"{dead}/v²", f"{dead}/notes.md")
    record(store_foreign=len(foreign) + 4, store_foreign_touched=sum(f not in after for f in foreign) + len(changed))
    assert gone and all(p.startswith((f"{dead}/v1", f"{dead}/v2")) for p in gone), gone
    assert changed == [], changed
    for entry in foreign:
        assert entry in after, entry
    assert _tree(root / "p" / "run-old (copy)") == _tree(root / "p" / "run-old-backup")


def test_a_store_listing_survives_odd_version_names(tmp_path):
    store = DiskStore(tmp_path, run="r")
    store.write(tiny_adapter(1), "p", 1)
    for odd in ("v²", "v03", "v3 (copy)", "v٣"):
        (store.run_dir("p") / odd).mkdir()
        (store.run_dir("p") / odd / "lorasync.json").write_text("{}")
    assert store.versions("p") == [1]
    # A foreign folder where a new version goes is neither taken for it nor replaced.
    (store.run_dir("p") / "v2").mkdir()
    (store.run_dir("p") / "v2" / "notes.txt").write_text("mine")
    from lorasync.errors import StorageError

    with pytest.raises(StorageError, match="in the way"):
        store.write(tiny_adapter(2), "p", 2)
    assert (store.run_dir("p") / "v2" / "notes.txt").read_text() == "mine" and store.versions("p") == [1]
    store.close()


# -- item 17: concurrent stateless calls ---------------------------------------------------------


def test_concurrent_publish_adapter_calls_of_one_name_all_succeed(tmp_path):
    """Item 17: two ``publish_adapter`` calls at once (a thread per engine, as a trainer fanning
    out by hand would) shared the process's run; the second failed with ConfigError."""
    engines = [MemoryEngine(f"memory://{i}") for i in range(4)]
    root = tmp_path / "store"
    for step in range(1, 5):
        with ThreadPoolExecutor(len(engines)) as pool:
            reports = list(pool.map(lambda e, s=step: publish_adapter(tiny_adapter(s), e, name="p", version=s, root=root), engines))
        record(stateless_concurrent=len(reports), stateless_concurrent_failed=sum(not r.ok for r in reports))
        for report in reports:
            assert report.ok, report
        assert all(e.list_adapters() and max(e.list_adapters()) == f"p@v{step}" for e in engines)
    # One run for the process, and retention still collects its old files (keep=2).
    (run,) = [p for p in (root / "p").iterdir()]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("v")) == ["v3", "v4"]


def test_concurrent_apublish_adapter_calls_of_one_name_all_succeed(tmp_path):
    engines = [MemoryEngine(f"memory://{i}") for i in range(4)]
    root = tmp_path / "store"

    async def steps() -> None:
        for step in range(1, 4):
            reports = await asyncio.gather(*(apublish_adapter(tiny_adapter(step), e, name="p", version=step, root=root) for e in engines))
            for report in reports:
                assert report.ok, report

    asyncio.run(steps())
    assert all(sorted(e.list_adapters()) == ["p@v2", "p@v3"] for e in engines)


def test_stateless_calls_to_different_engines_never_delete_files_one_still_serves(tmp_path):
    """The calls of one process share one run: the second engine's load of a version must add to
    its holders record, not replace it, or the first engine's version loses its files once the
    second retires it (vLLM reloads an evicted adapter from that path: its engine core dies)."""
    lagging, leading = MemoryEngine("memory://lagging"), MemoryEngine("memory://leading")
    root = tmp_path / "store"
    for engine in (lagging, leading):
        assert publish_adapter(tiny_adapter(1), engine, name="p", version=1, root=root, keep=1).ok
    for v in (2, 3):  # only the leading engine moves on; the lagging one still serves p@v1
        assert publish_adapter(tiny_adapter(v), leading, name="p", version=v, root=root, keep=1).ok
    assert lagging.list_adapters() == ["p@v1"]
    assert (Path(lagging.path_of("p@v1")) / "adapter_model.safetensors").is_file(), "files of a served version were deleted"


def test_a_sync_call_inside_the_coroutine_holding_the_run_is_a_typed_error(tmp_path):
    """The turn on the process's run is held by an ``apublish_adapter`` on this thread's loop: a
    sync ``publish_adapter`` from a coroutine of that loop would wait for ever, so it refuses."""
    engine = MemoryEngine()
    root = tmp_path / "store"

    async def main() -> None:
        entered, leave = asyncio.Event(), asyncio.Event()
        original = engine.aload_adapter

        async def aload(name: str, path: str) -> None:
            entered.set()
            await leave.wait()
            await original(name, path)

        engine.aload_adapter = aload  # type: ignore[method-assign]
        task = asyncio.create_task(apublish_adapter(tiny_adapter(1), engine, name="p", version=1, root=root))
        await entered.wait()
        with pytest.raises(ConfigError, match="apublish_adapter"):
            publish_adapter(tiny_adapter(2), MemoryEngine(), name="p", version=2, root=root)
        leave.set()
        assert (await task).ok

    asyncio.run(asyncio.wait_for(main(), 60))


# -- item 18 and the fork suspicion: a forked child owns nothing ---------------------------------


def _trainer_with_a_worker(root: Path, *, run: str | None, spawn: bool = False) -> tuple[str, int]:
    """A trainer that publishes, starts a data-loader worker (forked, or a subprocess with
    ``spawn``) that lives on, then is SIGKILLed. Returns ``(the trainer's run, the worker's pid)``."""
    import subprocess
    import sys

    rfd, wfd = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the trainer
        try:
            os.close(hold_w)
            pub = Publisher([MemoryEngine()], name="p", keep=2, root=root, run=run)
            pub.publish(tiny_adapter(1), version=1).settled()
            if spawn:  # waits until the test lets it go (its stdin closes)
                worker = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=hold_r, close_fds=False).pid
            else:
                worker = os.fork()
                if worker == 0:
                    os.close(wfd)  # the test reads the trainer's pipe to its end
                    os.read(hold_r, 1)
                    os._exit(0)
            os.write(wfd, f"{pub.run} {worker}".encode())
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(1)
    os.close(wfd)
    os.close(hold_r)
    with os.fdopen(rfd, "rb") as said:
        dead, worker = said.read().decode().split()
    os.waitpid(pid, 0)
    _WORKERS.append(hold_w)
    return dead, int(worker)


_WORKERS: list[int] = []


@pytest.fixture(autouse=True)
def _let_workers_go():
    yield
    while _WORKERS:
        os.close(_WORKERS.pop())  # the worker's read returns: it exits


def test_resuming_a_run_works_while_a_dead_trainers_worker_lives(tmp_path):
    """Item 18: a forked child (a data-loader worker) inherited the run's flock; after the trainer
    died, resuming ``run="exp42"`` failed as "owned by another live process"."""
    root = tmp_path / "store"
    _, worker = _trainer_with_a_worker(root, run="exp42")
    os.kill(worker, 0)  # the worker is alive
    engine = MemoryEngine()
    with Publisher([engine], name="p", keep=2, root=root, run="exp42") as pub:
        report = pub.publish(tiny_adapter(2), version=2).settled()
        assert report.ok, report
    record(fork_owner_cases=1)


def test_a_dead_trainers_run_is_swept_while_its_worker_lives(tmp_path):
    root = tmp_path / "store"
    dead, worker = _trainer_with_a_worker(root, run=None)
    os.kill(worker, 0)
    with Publisher([MemoryEngine()], name="p", keep=2, root=root) as pub:
        assert pub.publish(tiny_adapter(3), version=1).settled().ok
        assert sorted(p.name for p in (root / "p").iterdir()) == [pub.run], f"the dead run {dead} was not swept"


def test_a_forked_child_never_writes_into_its_parents_run(tmp_path):
    """Suspected in issue 28 and true on main: a child reusing the parent's store (or the
    process-wide run of the stateless calls) wrote into the parent's run without its lock. The
    parent's store refuses in the child; a stateless call in the child takes its own run."""
    root = tmp_path / "store"
    engine = MemoryEngine()
    assert publish_adapter(tiny_adapter(1), engine, name="p", version=1, root=root).ok
    store = DiskStore(root, run="parent")
    store.write(tiny_adapter(1), "p", 1)
    (parent_run,) = [p.name for p in (root / "p").iterdir() if p.name != "parent"]
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        said = []
        try:
            try:
                store.write(tiny_adapter(2), "p", 2)
                said.append("wrote")
            except ConfigError as exc:
                said.append("refused" if "fork" in str(exc) else f"other: {exc}")
            child = MemoryEngine()
            report = publish_adapter(tiny_adapter(3), child, name="p", version=3, root=root)
            said.append(str(Path(child.path_of("p@v3")).parent.name) if report.ok else f"failed: {report}")
        finally:
            os.write(wfd, "|".join(said).encode())
            os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as answer:
        said = answer.read().decode().split("|")
    os.waitpid(pid, 0)
    assert said[0] == "refused", said
    assert said[1] not in (parent_run, "parent") and said[1].startswith("run-"), said
    assert store.versions("p") == [1]
    assert sorted(p.name for p in (root / "p" / parent_run).iterdir() if p.name.startswith("v")) == ["v1"]
    store.close()


def test_a_subprocess_of_a_dead_trainer_never_holds_its_run(tmp_path):
    """Exec'd children (``subprocess``, even with ``close_fds=False``) never inherit the lock:
    its descriptor is O_CLOEXEC. (This held on main too; it guards the lock's flags.)"""
    root = tmp_path / "store"
    _, worker = _trainer_with_a_worker(root, run="exp42", spawn=True)
    os.kill(worker, 0)
    with Publisher([MemoryEngine()], name="p", keep=2, root=root, run="exp42") as pub:
        assert pub.publish(tiny_adapter(2), version=2).settled().ok


# -- issue 33 item 20: a record no parser can follow is foreign, never a failure ----------------


DEEP = b"[" * 100_000 + b"]" * 100_000  # valid JSON that nests deeper than any parser's stack


def _plant(file: Path) -> None:
    staged = file.with_name(".planted")
    staged.write_bytes(DEEP)
    os.replace(staged, file)


@pytest.mark.parametrize("record_file", [".holders.json", "lorasync.json", "run.json"])
def test_a_deeply_nested_record_under_the_root_never_fails_a_publish(tiny_model_dir, tmp_path, record_file):
    """Item 20: a deeply nested ``.holders.json`` of another run made every publish fail with
    ``EngineError ... RecursionError`` (json.loads raises RecursionError, not ValueError); a
    nested ``lorasync.json`` of a run the engine loaded from did the same. Both are another
    run's records: read bounded, and ignored like any record that is not lorasync's."""
    from lorasync.engines.peft import PeftEngine
    from lorasync.exporters.fsdp import export

    from ._trust import same, served_lora, state, trainer

    root = tmp_path / "store"
    engine = PeftEngine(base_model_path=tiny_model_dir)
    where = record_file if record_file == "run.json" else f"v1/{record_file}"
    dead = _dead_job(root)  # a job killed with its versions on disk
    _plant(root / "p" / dead / where)
    with Publisher([engine], name="p", transport="disk", root=root, run="run-live") as other:
        assert other.publish(export(trainer(tiny_model_dir, seed=5)), version=1).settled().ok  # the engine holds it
        _plant(root / "p" / "run-live" / where)
        model = trainer(tiny_model_dir, seed=3)
        with Publisher([engine], name="p", transport="disk", keep=2, root=root) as pub:
            for v in (2, 3):
                report = pub.publish(export(model), version=v).settled()
                assert report.ok, report
                assert same(served_lora(engine, report.served_name), state(model))
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        if ".lora_B." in n:
                            p.mul_(1.5)
        report = publish_adapter(export(model), engine, name="p", version=4, transport="disk", root=root)
        assert report.ok, report
        assert same(served_lora(engine, report.served_name), state(model))
