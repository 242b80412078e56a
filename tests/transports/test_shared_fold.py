"""Merged fan-out: one fold per publish for every engine, the same bytes as folding per engine,
and a failing fold fails every engine (never a short stream that looks complete)."""

from __future__ import annotations

import threading

import pytest
import torch

from lorasync.transports._fold import SharedFold


def _buckets(n: int, fail_at: int | None = None):
    for i in range(n):
        if i == fail_at:
            raise RuntimeError("fold failed")
        yield {f"w{i}": torch.full((4,), float(i))}


def _drain(reader, out, errors) -> None:
    try:
        out.extend(reader)
    except RuntimeError as exc:
        errors.append(exc)


def test_readers_get_every_bucket_from_one_fold() -> None:
    fold = SharedFold(lambda: _buckets(5))
    readers = [fold.join() for _ in range(4)]
    outs, errors = [[] for _ in readers], []
    threads = [threading.Thread(target=_drain, args=(r, o, errors)) for r, o in zip(readers, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and fold.folds == 1
    for out in outs:
        assert [list(b) for b in out] == [[f"w{i}"] for i in range(5)]
        assert all(torch.equal(b[f"w{i}"], torch.full((4,), float(i))) for i, b in enumerate(out))
    assert fold._held == {}  # nothing kept after the last reader
    assert fold.join() is None  # too late to share: the caller folds on its own


def test_a_failed_fold_fails_every_reader() -> None:
    fold = SharedFold(lambda: _buckets(5, fail_at=2))
    first, second = fold.join(), fold.join()
    assert next(first) and next(second)
    with pytest.raises(RuntimeError):
        list(first)
    with pytest.raises(RuntimeError):
        list(second)


def test_a_reader_that_leaves_releases_its_buckets() -> None:
    fold = SharedFold(lambda: _buckets(3))
    stays, leaves = fold.join(), fold.join()
    next(stays)
    leaves.close()
    assert len(list(stays)) == 2 and fold._held == {}


def test_publisher_folds_once_for_all_engines_with_the_same_bytes(monkeypatch, tmp_path) -> None:
    from lorasync import Adapter, AdapterConfig, BaseWeights, Publisher
    from lorasync.engines._engine import Capabilities, Engine
    from lorasync.transports import _fold

    class WeightEngine(Engine):
        kind = "weights-test"

        def __init__(self) -> None:
            self.weights: dict[str, torch.Tensor] = {}

        def capabilities(self) -> Capabilities:
            return Capabilities(engine=self.kind, lora=False, weight_update=True)

        def load_adapter(self, name, path) -> None:
            raise AssertionError("merged only")

        def unload_adapter(self, name) -> None:
            raise AssertionError("merged only")

        def list_adapters(self) -> list[str]:
            return []

        def update_weights(self, named_tensors) -> None:
            self.weights.update({k: v.clone() for k, v in named_tensors.items()})

    g = torch.Generator().manual_seed(0)
    modules = [f"model.layers.{i}.self_attn.o_proj" for i in range(3)]
    base = BaseWeights(tensors={f"{m}.weight": torch.randn(16, 16, generator=g) for m in modules})
    tensors = {}
    for m in modules:
        tensors[f"base_model.model.{m}.lora_A.weight"] = torch.randn(4, 16, generator=g)
        tensors[f"base_model.model.{m}.lora_B.weight"] = torch.randn(16, 4, generator=g)
    adapter = Adapter(tensors, AdapterConfig(r=4, lora_alpha=8))
    folds = []
    real = _fold.fold_module
    monkeypatch.setattr(_fold, "fold_module", lambda *a, **k: folds.append(a[1]) or real(*a, **k))
    fleet = [WeightEngine() for _ in range(4)]
    pub = Publisher(fleet, name="m", transport="merged", base=base, root=tmp_path, bucket_bytes=2 * 16 * 16 * 4)
    try:
        assert pub.publish(adapter, version=1).ok
    finally:
        pub.close()
    assert sorted(folds) == sorted(modules), "one fold per module for all four engines"
    expected = {k: v for b in _fold.fold_buckets(adapter, base, bucket_bytes=1 << 20) for k, v in b.items()}
    for engine in fleet:
        assert engine.weights.keys() == expected.keys()
        assert all(torch.equal(engine.weights[k], v) for k, v in expected.items())
