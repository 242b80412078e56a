"""Restore and roll-back never read the trainer's live tensors (issue 28 items 1 and 2; design
invariant 7).

A no-copy export (``fsdp.export``) wraps the trainer's own tensors, and the optimizer changes
them in place between publishes. Whatever the publisher puts back after a failed verification
(in place) or a failed merged update must be the previous version's bytes: from an owned copy or
the version's files. Real peer: the in-process PEFT engine; what it serves is read from its own
parameters and compared bit for bit.
"""

from __future__ import annotations

import torch

from lorasync import Probe, Publisher
from lorasync.engines.peft import PeftEngine
from lorasync.errors import EngineUnavailableError, VerificationError
from lorasync.exporters.fsdp import export

from ._trust import PROMPT, greedy, same, served_lora, state, step, trainer


def _failing_probe(model) -> Probe:
    """A probe no engine serving ``model``'s weights passes (a verification that fails)."""
    return Probe(prompt_ids=PROMPT, expected_ids=[t ^ 1 for t in greedy(model, PROMPT)])


def test_in_place_failed_verification_puts_back_the_previous_version_not_the_trainers_new_weights(tiny_model_dir, tmp_path):
    """Item 1: every publish verified (so a copy is armed); the trainer steps in place; v2's
    verification fails. The engine must serve v1's exact weights again, not the live tensors."""
    model = trainer(tiny_model_dir)
    engine = PeftEngine(base_model_path=tiny_model_dir)
    with Publisher([engine], name="p", in_place=True, root=tmp_path) as pub:
        v1 = state(model)
        assert pub.publish(export(model), version=1, verify=Probe.from_model(model, PROMPT, max_tokens=4)).ok
        step(model, seed=11)  # the optimizer: same tensors, new values
        report = pub.publish(export(model), version=2, verify=_failing_probe(model))
        error = report.results[0].error
        assert isinstance(error, VerificationError), report
        assert same(served_lora(engine, "p"), v1), f"{error}: yet p does not serve v1's weights"
        assert "v1 was put back" in str(error)


def test_in_place_without_a_kept_copy_never_leaves_the_failed_weights_serving(tiny_model_dir, tmp_path):
    """Item 1, first verification of the run (nothing armed a copy of v1): v1 cannot come back
    from the trainer's moved-on tensors, so the name is taken out of service and the error says
    so, instead of claiming a restore while serving v2's failed weights."""
    model = trainer(tiny_model_dir)
    engine = PeftEngine(base_model_path=tiny_model_dir)
    with Publisher([engine], name="p", in_place=True, root=tmp_path) as pub:
        assert pub.publish(export(model), version=1).ok
        step(model, seed=12)
        v2 = state(model)
        error = pub.publish(export(model), version=2, verify=_failing_probe(model)).results[0].error
        assert isinstance(error, VerificationError)
        served = served_lora(engine, "p")
        assert not same(served, v2), f"{error}: yet p serves the weights that failed verification"
        assert served == {} and "unloaded" in str(error) and "put back" not in str(error), str(error)


def test_in_place_through_files_restores_the_previous_version_from_its_files(tiny_model_dir, tmp_path):
    """Item 1, in place through files (transport='disk'): the previous version's directory is
    the restore point, exact even though no probe armed a copy."""
    model = trainer(tiny_model_dir)
    engine = PeftEngine(base_model_path=tiny_model_dir)
    with Publisher([engine], name="p", in_place=True, transport="disk", root=tmp_path) as pub:
        v1 = state(model)
        assert pub.publish(export(model), version=1).ok
        step(model, seed=13)
        error = pub.publish(export(model), version=2, verify=_failing_probe(model)).results[0].error
        assert isinstance(error, VerificationError)
        assert same(served_lora(engine, "p"), v1), f"{error}: yet p does not serve v1's weights"
        assert "v1 was put back" in str(error)


class _FailingUpdates(PeftEngine):
    """The PEFT engine whose ``fail_at``-th weight update fails (a connection lost mid-merge)."""

    fail_at: int | None = None
    updates = 0

    def update_weights(self, named_tensors):
        self.updates += 1
        if self.updates == self.fail_at:
            raise EngineUnavailableError("connection lost in the middle of a merged update", engine=self.kind)
        super().update_weights(named_tensors)


def _base_weights(engine) -> dict[str, torch.Tensor]:
    with engine._lock:
        return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def test_failed_merged_update_rolls_back_to_the_previous_merge_not_the_trainers_new_weights(tiny_model_dir, tmp_path):
    """Item 2: a merged publish fails half-way (bucket 2 of v2); the engine must hold v1's merged
    weights again, folded from v1's bytes, not from the trainer's tensors (now v2's)."""
    model = trainer(tiny_model_dir)
    engine = _FailingUpdates(base_model_path=tiny_model_dir)
    with Publisher([engine], name="p", transport="merged", base=tiny_model_dir, bucket_bytes=1, root=tmp_path) as pub:
        assert pub.publish(export(model), version=1).ok
        merged_v1 = _base_weights(engine)
        step(model, seed=14)
        engine.fail_at = engine.updates + 2
        report = pub.publish(export(model), version=2)
        assert isinstance(report.results[0].error, EngineUnavailableError), report
        after = _base_weights(engine)
        wrong = [n for n in merged_v1 if not torch.equal(merged_v1[n], after[n])]
        assert wrong == [], f"after the failed merge {len(wrong)} weights are not v1's, e.g. {wrong[:2]}"


def test_failed_merged_verification_puts_the_previous_merge_back(tiny_model_dir, tmp_path):
    """Item 2: a merged publish that fails verification is taken out of service like any other:
    the previous merge comes back (from its own copy), as the error says."""
    model = trainer(tiny_model_dir)
    engine = PeftEngine(base_model_path=tiny_model_dir)
    with Publisher([engine], name="p", transport="merged", base=tiny_model_dir, root=tmp_path) as pub:
        assert pub.publish(export(model), version=1).ok
        merged_v1 = _base_weights(engine)
        step(model, seed=15)
        error = pub.publish(export(model), version=2, verify=_failing_probe(model)).results[0].error
        assert isinstance(error, VerificationError)
        after = _base_weights(engine)
        assert all(torch.equal(merged_v1[n], after[n]) for n in merged_v1), f"{error}: yet the engine keeps v2's merge"
        assert "previous merge was put back" in str(error), str(error)
        # And the publisher knows it: the next publish of v2's content merges it again.
        assert pub.publish(export(model), version=3).results[0].status == "loaded"


# -- issue 33 item 19: an in-process engine never keeps the trainer's live tensors -------------


def _served_by_memory(engine, served: str) -> dict[str, torch.Tensor]:
    return {k: t.clone() for k, t in engine.adapters[served].tensors.items()}


def test_ipc_to_an_in_process_engine_that_keeps_tensors_serves_v1_after_the_optimizer_steps(tiny_model_dir, tmp_path):
    """Item 19: ``transport="ipc"`` after a no-copy export handed the trainer's own tensors to
    an in-process engine that keeps what it is given (``MemoryEngine``, or any plugin engine that
    does not copy), so the next optimizer step changed what ``p@v1`` served. Two such engines
    in one publish share one owned copy (copied once, not per engine)."""
    from lorasync.testing import MemoryEngine

    from ._trust import lora_params, optimizer_step

    model = trainer(tiny_model_dir)
    optimizer = torch.optim.AdamW(lora_params(model), lr=1e-2)
    engines = [MemoryEngine(), MemoryEngine()]
    with Publisher(engines, name="p", transport="ipc", root=tmp_path) as pub:
        v1 = state(model)
        report = pub.publish(export(model), version=1)
        assert report.ok and report.served_name == "p@v1", report
        optimizer_step(optimizer, model, seed=21)
        assert not same(state(model), v1)  # the trainer moved on, in place
        for engine in engines:
            assert same(_served_by_memory(engine, "p@v1"), v1), "p@v1 serves the trainer's new weights"
        kept = [engine.adapters["p@v1"].tensors for engine in engines]
        assert all(kept[0][k].data_ptr() == kept[1][k].data_ptr() for k in kept[0]), "copied once per engine"
        assert pub.publish(export(model), version=2).ok
        v2 = state(model)
        optimizer_step(optimizer, model, seed=22)
        assert same(_served_by_memory(engines[0], "p@v2"), v2)


def test_an_engine_that_copies_what_it_loads_still_gets_the_trainers_tensors_zero_copy(tiny_model_dir, tmp_path):
    """The PEFT engine copies the tensors into its own parameters (``copies_tensors``): it is
    handed the trainer's memory as is (no second copy on the hot path), and serves v1's exact
    bytes after the optimizer steps, over ipc and in place."""
    from ._trust import lora_params, optimizer_step

    handed: list[int] = []

    class Spy(PeftEngine):
        def load_adapter_tensors(self, name, adapter):
            handed.extend(t.data_ptr() for t in adapter.tensors.values())
            super().load_adapter_tensors(name, adapter)

    for options in ({"transport": "ipc"}, {"in_place": True}):
        model = trainer(tiny_model_dir)
        optimizer = torch.optim.AdamW(lora_params(model), lr=1e-2)
        engine = Spy(base_model_path=tiny_model_dir)
        handed.clear()
        with Publisher([engine], name="p", root=tmp_path / str(len(options)), **options) as pub:
            v1 = state(model)
            report = pub.publish(export(model), version=1)
            assert report.ok, report
            optimizer_step(optimizer, model, seed=23)
            assert same(served_lora(engine, report.served_name), v1), options
        if options.get("transport") == "ipc":
            assert set(handed) <= {p.data_ptr() for p in lora_params(model)} and handed, "a copy on the hot path"
