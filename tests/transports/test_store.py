"""DiskStore: atomic, immutable, versioned directories; crashes leave nothing visible."""

import os

import pytest
import torch
from peft import LoraConfig

from lorasync import Adapter, AdapterConfig
from lorasync.errors import PublishError
from lorasync.transports import DiskStore


def _adapter(seed=0, r=4):
    g = torch.Generator().manual_seed(seed)
    m = "model.layers.0.self_attn.q_proj"
    return Adapter(
        {f"base_model.model.{m}.lora_A.weight": torch.randn(r, 32, generator=g), f"base_model.model.{m}.lora_B.weight": torch.randn(32, r, generator=g)},
        AdapterConfig(r=r, lora_alpha=8),
    )


def test_write_is_complete_and_loadable(tmp_path):
    store = DiskStore(tmp_path)
    ad = _adapter()
    path, written = store.write(ad, "policy", 3)
    assert path == tmp_path / "policy" / store.run / "v3" and written > ad.nbytes
    assert sorted(os.listdir(path)) == ["adapter_config.json", "adapter_model.safetensors", "lorasync.json"]
    again = Adapter.load(path)
    assert again.content_hash == ad.content_hash
    assert LoraConfig.from_pretrained(str(path)).r == 4
    assert store.versions("policy") == [3] and store.content_hash("policy", 3) == ad.content_hash


def test_versions_are_immutable_and_idempotent(tmp_path):
    store = DiskStore(tmp_path)
    store.write(_adapter(0), "p", 1)
    assert store.write(_adapter(0), "p", 1)[1] == 0  # identical: nothing written
    with pytest.raises(PublishError, match="immutable"):
        store.write(_adapter(1), "p", 1)
    assert Adapter.load(tmp_path / "p" / store.run / "v1").content_hash == _adapter(0).content_hash


def test_remove_and_sweep_leftovers_of_dead_writers(tmp_path):
    # A writer killed mid-write in its own run leaves a temp dir; whoever owns the run next
    # (a resumed run) clears it before writing.
    dead = tmp_path / "p" / "resumed" / ".tmp-v2-deadbeef"
    dead.mkdir(parents=True)
    (dead / "adapter_model.safetensors").write_bytes(b"partial")
    store = DiskStore(tmp_path, run="resumed")
    store.write(_adapter(0), "p", 1)
    assert not dead.exists()
    assert store.versions("p") == [1]
    store.write(_adapter(1), "p", 2)
    store.remove("p", 1)
    assert store.versions("p") == [2]
    assert sorted(e.name for e in store.run_dir("p").iterdir() if not e.name.startswith(".")) == ["run.json", "v2"]
    store.close()


def test_write_failure_leaves_no_visible_version(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "rename", boom)
    from lorasync.errors import StorageError

    with pytest.raises(StorageError, match="free space"):
        store.write(_adapter(), "p", 1)
    monkeypatch.undo()
    assert store.versions("p") == []
    assert not store.path_for("p", 1).exists()
    # Nothing half-written is left behind either (a full disk must not fill up with temp dirs).
    assert [e.name for e in store.run_dir("p").iterdir() if e.name.startswith(".tmp-")] == []


def test_a_sweep_probing_a_new_run_never_makes_its_owner_fail(tmp_path):
    """Another job's orphan sweep holds a run's lock for a moment to test whether it is dead; the
    run's owner taking its lock right then waits for it instead of failing."""
    import fcntl
    import threading
    import time

    from lorasync.transports._store import OWNER_LOCK

    store = DiskStore(tmp_path, run="fresh")
    run_dir = store.run_dir("p")
    run_dir.mkdir(parents=True)
    probe = open(run_dir / OWNER_LOCK, "ab")
    fcntl.flock(probe.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    threading.Timer(0.2, probe.close).start()  # the sweep lets go
    start = time.monotonic()
    assert store.own("p") == run_dir
    assert time.monotonic() - start >= 0.15
    store.close()
