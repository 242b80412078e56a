"""Publisher semantics: retention, fencing, dedup, partial failure, capacity, verify, hostile names."""

import asyncio

import pytest

from lorasync import Probe, Publisher, publish_adapter
from lorasync.errors import (
    CapacityError,
    EngineUnavailableError,
    InvalidNameError,
    RankTooLargeError,
    StaleVersionError,
    VerificationError,
)
from lorasync.exporters.fsdp import export
from lorasync.testing import MemoryEngine

from .conftest import PROMPTS, reference


@pytest.fixture
def adapters(trainer):
    cache = {}

    def get(seed):
        if seed not in cache:
            cache[seed] = export(trainer(seed=seed))
        return cache[seed]

    return get


def dirs(root, name):
    """Version directories of ``name`` on disk, over every run under ``root``."""
    path = root / name
    if not path.exists():
        return []
    return sorted(v.name for run in path.iterdir() if run.is_dir() for v in run.iterdir() if v.is_dir() and not v.name.startswith("."))


def test_retention_keeps_only_keep_versions_loaded_and_on_disk(adapters, tmp_path):
    engine = MemoryEngine()
    pub = Publisher([engine], name="policy", keep=2, root=tmp_path)
    for v in range(1, 6):
        report = pub.publish(adapters(v), version=v)
        assert report.ok, report
    report.settled()  # old versions retire after the new one serves
    assert sorted(engine.list_adapters()) == ["policy@v4", "policy@v5"]
    assert dirs(tmp_path, "policy") == ["v4", "v5"]
    assert report.results[0].retired == ["policy@v3"]


def test_stateless_publish_adapter_also_retains_and_collects(adapters, tmp_path):
    engine = MemoryEngine()
    for v in range(1, 5):
        assert publish_adapter(adapters(v), engine, name="p", version=v, keep=1, root=tmp_path).ok
    assert engine.list_adapters() == ["p@v4"]
    assert dirs(tmp_path, "p") == ["v4"]


def test_older_version_never_replaces_newer(adapters, tmp_path):
    engine = MemoryEngine()
    assert publish_adapter(adapters(1), engine, name="p", version=5, root=tmp_path).ok
    # A different publisher (e.g. a restarted trainer) tries an older step.
    report = publish_adapter(adapters(2), engine, name="p", version=3, root=tmp_path)
    assert not report.ok
    assert isinstance(report.results[0].error, StaleVersionError)
    assert engine.list_adapters() == ["p@v5"]
    assert engine.adapters["p@v5"].content_hash == adapters(1).content_hash
    # Same version, different content: also refused.
    report = publish_adapter(adapters(2), engine, name="p", version=5, root=tmp_path)
    assert isinstance(report.results[0].error, StaleVersionError)


def test_identical_content_moves_no_bytes(adapters, tmp_path):
    engine = MemoryEngine()
    pub = Publisher([engine], name="p", root=tmp_path)
    first = pub.publish(adapters(1), version=1)
    assert first.results[0].bytes_moved > 0
    loads = engine.ops.count("load_adapter")
    again = pub.publish(adapters(1), version=2)
    assert again.ok and again.results[0].status == "unchanged" and again.bytes_moved == 0
    assert engine.ops.count("load_adapter") == loads
    assert again.served_name == "p@v1"  # the name that serves this content
    # A fresh publisher (restart) recognises it too, from the store's recorded hash.
    assert publish_adapter(adapters(1), engine, name="p", version=2, root=tmp_path).results[0].status == "unchanged"


def test_disk_publish_reads_the_adapter_once_and_unchanged_leaves_no_files(adapters, tmp_path, monkeypatch):
    from lorasync import Adapter

    passes = []
    original = Adapter._hashed_chunks

    def counted(self, h):
        passes.append(1)
        yield from original(self, h)

    monkeypatch.setattr(Adapter, "_hashed_chunks", counted)
    from lorasync.adapter import _adapter

    views = _adapter.host_views

    def counted_views(tensors):  # the in-place pass over plain host tensors (lorasync.adapter._memory)
        found = views(tensors)
        if found is not None:
            passes.append(1)
        return found

    monkeypatch.setattr(_adapter, "host_views", counted_views)
    engines = [MemoryEngine(f"memory://{i}") for i in range(3)]
    pub = Publisher(engines, name="p", transport="disk", root=tmp_path)
    fresh = Adapter(adapters(1).tensors, adapters(1).config)
    report = pub.publish(fresh, version=1).raise_for_errors()
    assert len(passes) == 1  # one pass over the tensors: hashed as they were written, for all three engines
    assert report.timings["hash"] == 0.0
    passes.clear()
    assert report.content_hash == fresh.content_hash == engines[0].adapters["p@v1"].content_hash
    assert [r.bytes_moved > 0 for r in report.results] == [True, True, True]
    again = pub.publish(Adapter(adapters(1).tensors, adapters(1).config), version=2)
    assert [r.status for r in again.results] == ["unchanged"] * 3
    assert dirs(tmp_path, "p") == ["v1"]  # v2 was written to learn its hash, then removed
    assert all(e.list_adapters() == ["p@v1"] for e in engines)
    pub.close()


def test_one_engine_down_others_succeed_and_report_is_exact(adapters, tmp_path):
    good1, down, good2 = MemoryEngine("memory://a"), MemoryEngine("memory://b"), MemoryEngine("memory://c")
    down.fail_next("load_adapter", EngineUnavailableError("connection refused", engine="memory"), times=1)
    report = Publisher([good1, down, good2], name="p", root=tmp_path).publish(adapters(1), version=1)
    assert not report.ok
    assert [r.status for r in report.results] == ["loaded", "failed", "loaded"]
    assert isinstance(report.results[1].error, EngineUnavailableError)
    assert good1.list_adapters() == good2.list_adapters() == ["p@v1"] and down.list_adapters() == []
    with pytest.raises(EngineUnavailableError):
        report.raise_for_errors()


def test_failed_load_keeps_previous_version_serving(adapters, tmp_path):
    engine = MemoryEngine()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path)
    assert pub.publish(adapters(1), version=1).ok
    engine.fail_next("load_adapter", EngineUnavailableError("boom"))
    report = pub.publish(adapters(2), version=2).settled()
    assert not report.ok
    assert engine.list_adapters() == ["p@v1"]
    assert dirs(tmp_path, "p") == ["v1", "v2"] or dirs(tmp_path, "p") == ["v1"]
    # The next publish recovers.
    assert pub.publish(adapters(2), version=3).settled().ok and engine.list_adapters() == ["p@v3"]


def test_multi_lora_names_are_independent(adapters, tmp_path):
    engine = MemoryEngine(max_loras=4)
    math = Publisher([engine], name="math", keep=2, root=tmp_path)
    code = Publisher([engine], name="code", keep=2, root=tmp_path)

    async def both(v):
        reports = await asyncio.gather(math.apublish(adapters(v), version=v), code.apublish(adapters(v + 10), version=v))
        return [await r.asettled() for r in reports]  # retired before this loop ends

    for v in (1, 2, 3):
        reports = asyncio.run(both(v))
        assert all(r.ok for r in reports), [str(r) for r in reports]
    assert sorted(engine.list_adapters()) == ["code@v2", "code@v3", "math@v2", "math@v3"]
    assert dirs(tmp_path, "math") == ["v2", "v3"] and dirs(tmp_path, "code") == ["v2", "v3"]


def test_capacity_is_a_clear_error_not_an_eviction(adapters, tmp_path):
    engine = MemoryEngine(max_loras=2)
    assert Publisher([engine], name="a", keep=1, root=tmp_path).publish(adapters(1), version=1).ok
    assert Publisher([engine], name="b", keep=1, root=tmp_path).publish(adapters(2), version=1).ok
    report = Publisher([engine], name="c", keep=1, root=tmp_path).publish(adapters(3), version=1)
    err = report.results[0].error
    assert isinstance(err, CapacityError) and "keep=" in str(err)
    assert sorted(engine.list_adapters()) == ["a@v1", "b@v1"]


def test_rank_above_engine_max_refused_before_bytes_move(trainer, tmp_path):
    engine = MemoryEngine(max_rank=4)
    report = Publisher([engine], name="p", root=tmp_path).publish(export(trainer(seed=1, r=8)), version=1)
    assert isinstance(report.results[0].error, RankTooLargeError)
    assert "load_adapter" not in engine.ops and not (tmp_path / "p").exists()


def test_rank_above_max_falls_back_to_merged_when_base_given(trainer, peft_engine, tiny_model_dir, tmp_path):
    from lorasync.engines.peft import PeftEngine

    engine = PeftEngine(base_model_path=tiny_model_dir, max_rank=4)
    model = trainer(seed=2, r=8)
    report = Publisher([engine], name="p", root=tmp_path, base=tiny_model_dir).publish(export(model), version=1)
    assert report.ok and report.results[0].transport == "merged" and "rank 8" in report.results[0].reason
    assert [engine.greedy(None, p, 6)[0] for p in PROMPTS] == [reference(model, p) for p in PROMPTS]


def test_verify_mismatch_fails_and_previous_version_keeps_serving(trainer, peft_engine, tmp_path):
    v1, v2 = trainer(seed=1), trainer(seed=2)
    pub = Publisher([peft_engine], name="p", root=tmp_path)
    assert pub.publish(export(v1), version=1, verify=Probe.from_model(v1, PROMPTS[0], max_tokens=4)).ok
    # A probe taken from a different model: the engine cannot reproduce it.
    report = pub.publish(export(v2), version=2, verify=Probe.from_model(v1, PROMPTS[1], max_tokens=4))
    assert isinstance(report.results[0].error, VerificationError)
    assert peft_engine.list_adapters() == ["p@v1"]
    ok = pub.publish(export(v2), version=3, verify=Probe.from_model(v2, PROMPTS[1], max_tokens=4))
    assert ok.ok and "verified" in ok.results[0].reason


@pytest.mark.parametrize("name", ["../x", "/abs", "a/b", "nul\x00", "x" * 10_000, "pоlicy"])
def test_hostile_names_rejected_before_anything_happens(name, adapters, tmp_path):
    engine = MemoryEngine()
    with pytest.raises(InvalidNameError):
        publish_adapter(adapters(1), engine, name=name, version=1, root=tmp_path)
    assert engine.ops == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("version", ["../1", -1, "1/2", 1.5])
def test_hostile_versions_rejected(version, adapters, tmp_path):
    engine = MemoryEngine()
    with pytest.raises(InvalidNameError):
        publish_adapter(adapters(1), engine, name="p", version=version, root=tmp_path)
    assert engine.ops == [] and list(tmp_path.iterdir()) == []


def test_engine_specs_and_async_twin(adapters, tmp_path):
    from lorasync import apublish_adapter

    engine = MemoryEngine()
    report = asyncio.run(apublish_adapter(adapters(1), [engine], name="p", version=1, root=tmp_path))
    assert report.ok and report.to_dict()["results"][0]["status"] == "loaded"
    assert "p@v1" in str(report)
