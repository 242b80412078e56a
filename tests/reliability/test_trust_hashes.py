"""A content hash is reused only under the same identity (issue 28 items 3, 4 and 15; design
invariant 8): "unchanged" is reported only for content the engine really serves under the name
the report gives, whatever another job on the same engine or store root did meanwhile.

Real peers: the in-process PEFT engine (served weights read from its own parameters) and, for
the engine shared by two jobs, the real vLLM CPU server. "The engine restarts" is what a restart
looks like from a client: every adapter is gone (``unload_adapter`` of each), then another job
loads its own.
"""

from __future__ import annotations

import pytest

from lorasync import Publisher
from lorasync.engines.peft import PeftEngine
from lorasync.exporters.fsdp import export

from ._trust import content_hash, same, served_lora, state, step, trainer


def _restart(engine) -> None:
    for name in engine.list_adapters():
        engine.unload_adapter(name)


def _serves_exactly(engine, report, tensors) -> None:
    """``report.served_name`` names, on ``engine``, exactly ``tensors``."""
    served = served_lora(engine, report.served_name)
    assert served, f"{report.served_name} ({report.results[0].status}) is not served at all: {engine.list_adapters()}"
    assert same(served, tensors), f"{report.served_name} ({[r.status for r in report.results]}) serves other weights than the report's"


def test_resync_after_a_restart_drops_the_remembered_hash_of_a_name_another_job_reloaded(tiny_model_dir, tmp_path):
    """Item 3a: job 1 serves p@v5; the engine restarts and job 2 loads its own p@v5; job 1 then
    publishes its v5 content again as v6. "Unchanged, served p@v5" would name job 2's weights."""
    ours, theirs = trainer(tiny_model_dir, seed=3), trainer(tiny_model_dir, seed=4)
    engine = PeftEngine(base_model_path=tiny_model_dir)
    job1 = Publisher([engine], name="p", root=tmp_path, run="job-1")
    job2 = Publisher([engine], name="p", root=tmp_path, run="job-2")
    try:
        assert job1.publish(export(ours), version=5).settled().ok
        _restart(engine)
        assert job2.publish(export(theirs), version=5).settled().ok
        report = job1.publish(export(ours), version=6).settled()
        assert report.ok, report
        _serves_exactly(engine, report, state(ours))
    finally:
        job1.close()
        job2.close()


def test_a_fresh_run_never_takes_another_runs_recorded_hash(tiny_model_dir, tmp_path):
    """Items 3b and 4: two jobs, each with its own in-process engine on the same base model and
    one store root, publish different p@v5; job 2's trainer restarts (a fresh run) and publishes
    job 1's content. Job 1's .holders.json names "the" peft engine of that base path; it is not
    job 2's engine, which serves job 2's weights."""
    mine, other = trainer(tiny_model_dir, seed=3), trainer(tiny_model_dir, seed=4)
    engine1, engine2 = PeftEngine(base_model_path=tiny_model_dir), PeftEngine(base_model_path=tiny_model_dir)
    disk = {"name": "p", "transport": "disk", "root": tmp_path}
    with Publisher([engine1], run="a-job-1", **disk) as job1, Publisher([engine2], run="b-job-2", **disk) as job2:
        assert job1.publish(export(mine), version=5).settled().ok
        assert job2.publish(export(other), version=5).settled().ok
    with Publisher([engine2], **disk) as restarted:  # job 2 again, fresh run
        report = restarted.publish(export(mine), version=6).settled()
        assert report.ok, report
        _serves_exactly(engine2, report, state(mine))
    assert engine1.instance_id != engine2.instance_id


def test_a_resumed_run_still_recognises_what_its_engine_serves(tiny_model_dir, tmp_path):
    """The identity rule keeps what is right: the same run, resumed on the same engine, still
    finds the hash recorded with the files the engine loaded and moves nothing for identical
    content."""
    model = trainer(tiny_model_dir)
    engine = PeftEngine(base_model_path=tiny_model_dir)
    with Publisher([engine], name="p", transport="disk", root=tmp_path, run="exp42") as first:
        assert first.publish(export(model), version=5).settled().ok
    with Publisher([engine], name="p", transport="disk", root=tmp_path, run="exp42") as resumed:
        report = resumed.publish(export(model), version=6).settled()
        assert [r.status for r in report.results] == ["unchanged"] and report.served_name == "p@v5"
        _serves_exactly(engine, report, state(model))


def test_mixed_fan_out_serves_the_reported_name_on_every_engine(tiny_model_dir, tmp_path):
    """Item 15: engine A already serves this content as p@v5, engine B lost it (restarted) and
    loads it as p@v6. report.served_name is what a user puts in model= for every engine."""
    model = trainer(tiny_model_dir)
    a, b = PeftEngine(base_model_path=tiny_model_dir), PeftEngine(base_model_path=tiny_model_dir)
    with Publisher([a, b], name="p", root=tmp_path) as pub:
        assert pub.publish(export(model), version=5).settled().ok
        _restart(b)
        report = pub.publish(export(model), version=6).settled()
        assert report.ok, report
        for label, engine in (("A", a), ("B", b)):
            assert report.served_name in engine.list_adapters(), f"{report.served_name} is not served by engine {label}: {engine.list_adapters()}"
            _serves_exactly(engine, report, state(model))
        # Identical content everywhere again: nothing moves, one name.
        again = pub.publish(export(model), version=7).settled()
        assert [r.status for r in again.results] == ["unchanged", "unchanged"] and again.served_name == report.served_name


def test_unchanged_is_decided_on_the_engines_own_content_after_someone_swapped_an_in_place_name(tiny_model_dir, tmp_path):
    """Item 3 in place: two publishers swap one plain name on one engine; the first must not
    call its earlier content "unchanged" after the second swapped its own weights in."""
    ours, theirs = trainer(tiny_model_dir, seed=3), trainer(tiny_model_dir, seed=4)
    engine = PeftEngine(base_model_path=tiny_model_dir)
    with Publisher([engine], name="p", in_place=True, root=tmp_path) as job1, Publisher([engine], name="p", in_place=True, root=tmp_path) as job2:
        assert job1.publish(export(ours), version=1).ok
        assert job2.publish(export(theirs), version=1).ok
        report = job1.publish(export(ours), version=2)
        assert report.ok, report
        _serves_exactly(engine, report, state(ours))


def test_report_hash_names_what_the_engine_serves_after_the_trainer_steps(tiny_model_dir, tmp_path):
    """Sanity for the tests above: the hash in the report is the served content's."""
    model = trainer(tiny_model_dir)
    engine = PeftEngine(base_model_path=tiny_model_dir)
    with Publisher([engine], name="p", root=tmp_path) as pub:
        for version in (1, 2):
            report = pub.publish(export(model), version=version).settled()
            assert report.content_hash == content_hash(served_lora(engine, report.served_name), model)
            step(model, seed=version)


@pytest.mark.vllm
def test_a_fresh_run_on_a_shared_vllm_server_takes_the_hash_of_what_the_server_loaded(vllm_server, tiny_model_dir, tmp_path):
    """Item 3b on a real shared server: job A's record says the server holds p@v5 (A's content);
    the server lost it and job B loaded its own p@v5 there. A fresh run publishing A's content
    must not report "unchanged" at p@v5: the server names the directory it loaded (B's)."""
    from lorasync.engines.vllm import VLLMEngine

    def adapter(seed: int):
        return export(trainer(tiny_model_dir, seed=seed))

    name = f"trust-{tmp_path.name[-12:].replace('_', '-')}"
    engine = VLLMEngine(vllm_server.url)
    try:
        with Publisher([engine], name=name, transport="disk", root=tmp_path, run="a-job") as job_a:
            assert job_a.publish(adapter(1), version=5).settled().ok
            engine.unload_adapter(f"{name}@v5")  # the server restarted, or an operator cleaned up
        with Publisher([engine], name=name, transport="disk", root=tmp_path, run="b-job") as job_b:
            assert job_b.publish(adapter(2), version=5).settled().ok
        with Publisher([engine], name=name, transport="disk", root=tmp_path) as fresh:
            report = fresh.publish(adapter(1), version=6).settled()
            assert report.ok, report
            assert [r.status for r in report.results] == ["loaded"] and report.served_name == f"{name}@v6", report
    finally:
        for served in engine.list_adapters():
            if served.startswith(f"{name}@"):
                engine.unload_adapter(served)
        engine.close()
