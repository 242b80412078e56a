"""Retention as a trainer lives it: requests still decoding while versions change, pins and leases,
an off-policy window, bounded deferral, capacity that never evicts a running version."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from lorasync import Adapter, AdapterConfig, Publisher, RetentionWarning
from lorasync.errors import CapacityError
from lorasync.testing import MemoryEngine

from ._inflight import ReloadingEngine

M = "model.layers.0.self_attn.q_proj"


def adapter(seed: int) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    return Adapter(
        {f"base_model.model.{M}.lora_A.weight": torch.randn(4, 32, generator=g), f"base_model.model.{M}.lora_B.weight": torch.randn(32, 4, generator=g)},
        AdapterConfig(r=4, lora_alpha=8),
    )


def on_disk(pub: Publisher) -> list[int]:
    return pub.store.versions(pub.name)


def test_running_request_keeps_its_version_loaded_and_its_files(tmp_path):
    engine = ReloadingEngine()
    pub = Publisher([engine], name="policy", keep=1, root=tmp_path, grace=0.0)
    assert pub.publish(adapter(1), version=1).settled().ok
    rid = engine.start("policy@v1")  # a long rollout on v1
    for v in (2, 3):
        report = pub.publish(adapter(v), version=v).settled()
        engine.step()
        assert report.ok, report
        assert report.results[0].deferred == ["policy@v1"]
        assert "policy@v1" in engine.list_adapters() and 1 in on_disk(pub)
    assert report.results[0].retired == ["policy@v2"]  # v2 had no requests: it went at once
    assert sorted(engine.list_adapters()) == ["policy@v1", "policy@v3"]
    engine.finish(rid)
    assert pub.collect() == {"retired": ["policy@v1"], "deferred": []}
    assert engine.list_adapters() == ["policy@v3"] and on_disk(pub) == [3]
    assert engine.violations == []


def test_files_outlive_the_unload_by_the_grace_on_engines_that_reload(tmp_path):
    engine = ReloadingEngine()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path, grace=30.0)
    pub.publish(adapter(1), version=1).settled()
    report = pub.publish(adapter(2), version=2).settled()
    assert report.results[0].retired == ["p@v1"]
    assert on_disk(pub) == [1, 2]  # unloaded, but vLLM may still re-read it for a request it admitted


def test_a_pinned_version_survives_any_number_of_publishes_and_retires_once_unpinned(tmp_path):
    engine = MemoryEngine()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path)
    pub.publish(adapter(1), version=1).settled()
    pub.pin(1)
    for v in range(2, 7):
        assert pub.publish(adapter(v), version=v).settled().ok
        assert "p@v1" in engine.list_adapters() and 1 in on_disk(pub)
    pub.unpin(1)
    report = pub.publish(adapter(7), version=7).settled()
    assert "p@v1" in report.results[0].retired
    assert engine.list_adapters() == ["p@v7"] and on_disk(pub) == [7]


def test_lease_pins_for_the_block(tmp_path):
    engine = MemoryEngine()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path)
    pub.publish(adapter(1), version=1).settled()
    with pub.lease(1) as model:
        assert model == "p@v1"
        pub.publish(adapter(2), version=2).settled()
        assert sorted(engine.list_adapters()) == ["p@v1", "p@v2"]
    assert pub.pinned == frozenset()
    pub.publish(adapter(3), version=3).settled()
    assert engine.list_adapters() == ["p@v3"]


def test_max_staleness_keeps_an_off_policy_window(tmp_path):
    engine = MemoryEngine()
    pub = Publisher([engine], name="p", keep=1, max_staleness=2, root=tmp_path)
    for v in range(1, 7):
        pub.publish(adapter(v), version=v).settled()
    assert sorted(engine.list_adapters()) == ["p@v4", "p@v5", "p@v6"]


def test_deferral_is_bounded_with_a_typed_warning(tmp_path):
    engine = ReloadingEngine()
    pub = Publisher([engine], name="p", keep=1, max_deferred=1, root=tmp_path, grace=0.0)
    pub.publish(adapter(1), version=1).settled()
    stuck1 = engine.start("p@v1")
    pub.publish(adapter(2), version=2).settled()
    engine.start("p@v2")
    with pytest.warns(RetentionWarning, match="max_deferred=1"):
        report = pub.publish(adapter(3), version=3).settled()
    assert report.results[0].retired == ["p@v1"] and report.results[0].deferred == ["p@v2"]
    # Unloaded anyway, but its files stay while the engine still reports the request on it.
    assert 1 in on_disk(pub)
    engine.finish(stuck1)
    pub.collect()
    assert 1 not in on_disk(pub)


class _Blind(MemoryEngine):
    """An engine that cannot report requests in flight (retirement waits out grace=)."""

    def adapters_in_use(self) -> None:
        return None


def test_a_bounded_grace_period_warns_without_claiming_requests_used_it(tmp_path):
    """Publishing faster than grace= on an engine that cannot report requests: the bound unloads
    the oldest, and the warning says what is known (it was inside its grace period), not that
    requests still used it (a benchmark's every-step publishes printed that claim each round)."""
    engine = _Blind()
    pub = Publisher([engine], name="p", keep=1, max_deferred=1, root=tmp_path, grace=60.0)
    pub.publish(adapter(1), version=1).settled()
    pub.publish(adapter(2), version=2).settled()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = pub.publish(adapter(3), version=3).settled()
    said = [str(w.message) for w in caught if issubclass(w.category, RetentionWarning)]
    assert len(said) == 1 and "p@v1" in said[0], said
    assert "cannot report requests in flight" in said[0] and "grace=60 s" in said[0], said[0]
    assert "requests still used it" not in said[0], said[0]
    assert report.results[0].retired == ["p@v1"] and report.results[0].deferred == ["p@v2"]
    assert sorted(engine.list_adapters()) == ["p@v2", "p@v3"]
    pub.close()


def test_drain_timeout_bounds_a_stuck_version(tmp_path):
    engine = ReloadingEngine()
    pub = Publisher([engine], name="p", keep=1, drain_timeout=0.0, root=tmp_path, grace=0.0)
    pub.publish(adapter(1), version=1).settled()
    engine.start("p@v1")
    with pytest.warns(RetentionWarning, match="drain_timeout"):
        report = pub.publish(adapter(2), version=2).settled()
    assert report.results[0].retired == ["p@v1"]


def test_capacity_never_evicts_a_running_version_and_refuses_before_unloading(tmp_path):
    engine = MemoryEngine(max_loras=1)
    pub = Publisher([engine], name="p", keep=1, root=tmp_path)
    pub.publish(adapter(1), version=1).settled()
    with engine.request("p@v1"):
        report = pub.publish(adapter(2), version=2).settled()
        result = report.results[0]
        assert isinstance(result.error, CapacityError)
        assert result.retired == [] and engine.list_adapters() == ["p@v1"]
        message = str(result.error)
        assert "lower keep" not in message  # impossible with keep=1: say what can be done
        assert "more adapter slots" in message and "transport='merged'" in message
    # Once the request finished, the same publish goes through and reports what it unloaded.
    report = pub.publish(adapter(2), version=2).settled()
    assert report.ok and report.results[0].retired == ["p@v1"] and engine.list_adapters() == ["p@v2"]


def test_close_retires_what_drained_and_keeps_what_still_runs(tmp_path):
    engine = ReloadingEngine()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path, grace=0.0)
    pub.publish(adapter(1), version=1).settled()
    pub.publish(adapter(2), version=2).settled()
    engine.start("p@v2")
    pub.publish(adapter(3), version=3).settled()
    pub.close()
    assert sorted(engine.list_adapters()) == ["p@v2", "p@v3"]
    assert os.path.isdir(pub.store.path_for("p", 2))


def test_two_jobs_one_root_same_name_never_touch_each_others_files(tmp_path):
    a_engine, b_engine = MemoryEngine("memory://a"), ReloadingEngine("reloading://b")
    a = Publisher([a_engine], name="policy", keep=1, root=tmp_path)
    b = Publisher([b_engine], name="policy", keep=1, root=tmp_path)
    assert a.run != b.run
    for v in range(1, 5):
        assert a.publish(adapter(v), version=v).settled().ok
        assert b.publish(adapter(100 + v), version=v).settled().ok  # same versions, other content: no collision
        b_engine.start(f"policy@v{v}")
        b_engine.step()
    a.close()
    for v in range(5, 7):
        assert b.publish(adapter(100 + v), version=v).settled().ok
        b_engine.step()
    # Every version b's engine still has requests on kept its files, and a's last one is intact.
    assert b_engine.violations == []
    assert a.store.versions("policy") == [4] and Adapter.load(a.store.path_for("policy", 4)).content_hash == adapter(4).content_hash
    b.close()


def test_a_rerun_publishes_from_version_1_again(tmp_path):
    for _ in range(2):  # the same training, twice, like the README snippet
        engine = MemoryEngine()
        with Publisher([engine], name="policy", keep=1, root=tmp_path) as pub:
            for v in range(1, 4):
                assert pub.publish(adapter(v * 7 + len(os.listdir(tmp_path))), version=v).ok


def test_a_run_is_owned_by_one_live_publisher(tmp_path):
    from lorasync.errors import ConfigError

    first = Publisher([MemoryEngine()], name="p", root=tmp_path, run="exp1")
    first.publish(adapter(1), version=1)
    second = Publisher([MemoryEngine()], name="p", root=tmp_path, run="exp1")
    report = second.publish(adapter(2), version=2)
    assert isinstance(report.results[0].error, ConfigError) and "exp1" in str(report.results[0].error)
    first.close()
    # Closed: a later publisher may resume the run (versions are immutable within it).
    resumed = Publisher([MemoryEngine()], name="p", root=tmp_path, run="exp1")
    assert resumed.publish(adapter(1), version=1).ok and resumed.store.versions("p") == [1]
    resumed.close()


def test_warnings_are_typed():
    assert issubclass(RetentionWarning, Warning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from lorasync.errors import LoraSyncWarning

        assert issubclass(RetentionWarning, LoraSyncWarning)


def test_a_publisher_started_after_another_was_killed_publishes_from_version_0(tmp_path):
    import signal

    root = tmp_path / "store"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the first job: publishes, then dies without a word
        try:
            engine = MemoryEngine()
            pub = Publisher([engine], name="policy", keep=2, root=root)
            for v in range(3):
                pub.publish(adapter(v), version=v).settled()
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    (dead_run,) = os.listdir(root / "policy")
    # The next job on this host, same root and name, starts again at version 0 with other content.
    engine = MemoryEngine()
    pub = Publisher([engine], name="policy", keep=2, root=root)
    for v in range(3):
        report = pub.publish(adapter(50 + v), version=v).settled()
        assert report.ok, report
    assert sorted(engine.list_adapters()) == ["policy@v1", "policy@v2"]
    # The dead job's versions were swept (its engine died with it); its run directory is gone.
    assert dead_run not in os.listdir(root / "policy") and os.listdir(root / "policy") == [pub.run]
    pub.close()
