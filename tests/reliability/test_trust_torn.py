"""A trainer that steps while a no-copy publish reads its tensors (issue 28 item 8; design
invariant 1): the report's hash, the recorded hash and the bytes the engine got must never
disagree silently, and the engine never serves a mix of two steps.

The step is made to land at one exact moment of the publish (inside the engine's tensor load, or
between two tensors of the disk write pass), the way a trainer thread's ``optimizer.step()``
lands there by chance. Real optimizers (torch.optim AdamW, fused and foreach) and a plain
in-place update; real peer: the in-process PEFT engine.
"""

from __future__ import annotations

import pytest
import torch

import lorasync.adapter._adapter
from lorasync import Publisher
from lorasync.engines.peft import PeftEngine
from lorasync.errors import AdapterChangedError
from lorasync.exporters.fsdp import export

from ._trust import content_hash, lora_params, optimizer_step, same, served_lora, state, step, trainer

STEPS = ("fused-adamw", "foreach-adamw", "in-place-add")


def _stepper(kind: str, model):
    """What one training step does to the trainer's LoRA tensors (in place)."""
    if kind == "in-place-add":
        return lambda seed: step(model, seed=seed)
    optimizer = torch.optim.AdamW(lora_params(model), lr=0.05, **({"fused": True} if kind == "fused-adamw" else {"foreach": True}))
    return lambda seed: optimizer_step(optimizer, model, seed=seed)


class _StepsDuringLoad(PeftEngine):
    """The trainer's thread steps while the engine copies the tensors in (``during``: the step)."""

    during = None

    def load_adapter_tensors(self, name, adapter):
        if self.during is not None:
            self.during()
        super().load_adapter_tensors(name, adapter)

    def load_adapter(self, name, path):
        if self.during is not None:
            self.during()
        super().load_adapter(name, path)


def _consistent_or_refused(engine, report, model) -> None:
    """Either the publish failed with AdapterChangedError and serves nothing of this version, or
    it is ok and the reported hash is the hash of exactly what the engine serves."""
    result = report.results[0]
    if not result.ok:
        assert isinstance(result.error, AdapterChangedError), report
        assert f"p@v{report.version}" not in engine.list_adapters(), "the torn version still serves"
        return
    served = served_lora(engine, report.served_name)
    assert report.content_hash == content_hash(served, model), (
        f"{report.served_name} is ok, but the reported hash is not the hash of what the engine serves"
    )


@pytest.mark.parametrize("kind", STEPS)
def test_a_step_during_a_tensor_load_is_refused_not_reported_ok(kind, tiny_model_dir, tmp_path):
    model = trainer(tiny_model_dir)
    engine = _StepsDuringLoad(base_model_path=tiny_model_dir)
    stepping = _stepper(kind, model)
    with Publisher([engine], name="p", transport="ipc", root=tmp_path) as pub:
        engine.during = lambda: stepping(1)
        report = pub.publish(export(model), version=1).settled()
        _consistent_or_refused(engine, report, model)
        assert not report.ok, "a step landed inside the load: the engine holds bytes of another step than the hash"
        assert "publish between optimizer steps" in str(report.results[0].error)
        # Between steps (the no-copy contract) the next publish serves exactly the trainer's weights.
        engine.during = None
        again = pub.publish(export(model), version=2).settled()
        assert again.ok and again.results[0].status == "loaded", again
        assert same(served_lora(engine, "p@v2"), state(model))


@pytest.mark.parametrize("kind", STEPS)
def test_a_step_during_the_disk_write_pass_leaves_no_torn_version(kind, tiny_model_dir, tmp_path, monkeypatch):
    model = trainer(tiny_model_dir)
    engine = PeftEngine(base_model_path=tiny_model_dir)
    stepping = _stepper(kind, model)
    before = state(model)
    written = []
    original = lorasync.adapter._adapter.raw_bytes

    def write_then_step(tensor):  # the write pass takes each tensor's bytes in turn
        written.append(1)
        if len(written) == 3:
            stepping(2)  # the trainer's step lands after two tensors were hashed and written
        return original(tensor)

    in_place = lorasync.adapter._adapter.host_views

    class _Stepping(list):  # the in-place pass (plain host tensors) reads each view in turn
        def __iter__(self):
            for i, item in enumerate(list.__iter__(self)):
                written.append(1)
                if len(written) == 3:
                    stepping(2)
                yield item

    def views_then_step(tensors):
        views = in_place(tensors)
        return None if views is None else _Stepping(views)

    with Publisher([engine], name="p", transport="disk", root=tmp_path) as pub:
        monkeypatch.setattr(lorasync.adapter._adapter, "raw_bytes", write_then_step)
        monkeypatch.setattr(lorasync.adapter._adapter, "host_views", views_then_step)
        report = pub.publish(export(model), version=1).settled()
        monkeypatch.undo()
        assert len(written) >= 3, "the step was never injected: the write pass took a path this test does not see"
        served = served_lora(engine, "p@v1")
        assert not served or same(served, before) or same(served, state(model)), "the engine serves a mix of two trainer steps"
        _consistent_or_refused(engine, report, model)
        assert pub.store.versions("p") == [], "the torn version's files (and their recorded hash) stayed in the store"


def test_a_step_after_the_files_are_written_is_no_tear(tiny_model_dir, tmp_path):
    """The disk transport reads the trainer's memory once, in the write pass: a step while the
    engine loads the finished files changes nothing the engine gets (no false alarm)."""
    model = trainer(tiny_model_dir)
    engine = _StepsDuringLoad(base_model_path=tiny_model_dir)
    before = state(model)
    with Publisher([engine], name="p", transport="disk", root=tmp_path) as pub:
        engine.during = lambda: step(model, seed=3)
        report = pub.publish(export(model), version=1).settled()
        assert report.ok, report
        assert same(served_lora(engine, "p@v1"), before)
        assert report.content_hash == content_hash(before, model) == pub.store.content_hash("p", 1)
