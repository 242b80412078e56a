"""A Hypothesis state machine over the Publisher, against the in-process PEFT engine (issue 28's
acceptance, first version).

The day it drives: a trainer publishes its no-copy export step after step (``publish``), its
optimizer changes the exported tensors in place afterwards (``train``), sometimes while a publish
reads them (``publish_while_training``); verifications fail (a probe no engine passes) and are
rolled back in place or on the merge; merged updates fail half-way; the engine "restarts" (every
adapter gone, as a client sees a restart); the trainer restarts (a new Publisher, resuming its
run or a fresh one); a second job publishes the same name to the same engine and store root;
``collect`` retires what drained; ``close`` ends a publisher (later calls are refused, typed) and
the trainer goes on with a new one on its run; a data-loader worker ``fork``s and touches the
publisher it inherited (refused at once, the parent unaffected); an ``apublish`` is cancelled
after a drawn number of event-loop turns (anywhere between its first and its last await).

Invariants, after every step and for every report a call returned:

* **every engine serves exactly the bytes its report says**: an ok result's served name holds
  exactly the trainer's tensors at publish time (the merged base exactly W0 + s·B·A of them), the
  report's content hash is theirs, and the greedy tokens are the trainer's own; a failed result
  that says the previous version was put back serves that version's bytes;
* **no call hangs**: every call runs under a deadline (``CALL_TIMEOUT_S``).

The last ok report's claim is re-checked after every later step until something may rightly
change the engine (a publish, a restart): training, a second job starting, a trainer
restarting, ``collect``, ``close`` or a fork must not change what it serves. And whatever the
engine lists under the adapter's name holds exactly the bytes of some publish of that name (a
cancelled one included): never a torn, mixed or mutated-after-export version.

One mode per run (``initialize``): versioned names over tensors or files, in place over tensors
or files, or merged; both jobs use it. To add a rule:
write a ``@rule`` method that drives ``self.jobs`` through :meth:`PublisherMachine.call` (bounded)
and, for each report it gets, calls :meth:`PublisherMachine.check`; state the rule needs goes on
:class:`Job`. A rule that may rightly change what the engine serves sets ``self.claim = None``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lorasync import Probe, Publisher
from lorasync.engines.peft import PeftEngine
from lorasync.errors import AdapterChangedError, EngineError, EngineTimeoutError, EngineUnavailableError, LoraSyncError, PublisherClosedError, StaleVersionError, VerificationError
from lorasync.exporters.fsdp import export
from lorasync.transports import BaseWeights
from lorasync.transports._fold import fold_module

from ._trust import PROMPT, content_hash, greedy, lora_params, same, served_lora, state, step, trainer

CALL_TIMEOUT_S = 120.0  # a tiny model on a loaded 2-core box; a hang shows as this deadline passing
MODES = ("ipc", "disk", "in-place", "in-place-files", "merged")
_BASE: list[Path] = []


def _base_dir() -> Path:
    """The tiny base model, built once per process (nothing downloads)."""
    if not _BASE:
        from lorasync.testing import make_tiny_model

        root = Path(tempfile.mkdtemp(prefix="lorasync-machine-base-"))
        atexit.register(shutil.rmtree, root, True)
        make_tiny_model(root / "base")
        _BASE.append(root / "base")
    return _BASE[0]


class MachineEngine(PeftEngine):
    """The PEFT engine, with three faults a test may arm: a step of the trainer landing inside a
    load (``during``), the ``fail_at``-th merged weight update failing, and the probe's generate
    raising (``probe_fault``: an engine error, or a timeout as when it is busy with rollouts)."""

    during: Any = None
    fail_at: int | None = None
    updates = 0
    probe_fault: Exception | None = None

    def greedy(self, name, prompt_ids, max_tokens):
        if self.probe_fault is not None:
            raise self.probe_fault
        return super().greedy(name, prompt_ids, max_tokens)

    def load_adapter_tensors(self, name, adapter):
        self._during()
        super().load_adapter_tensors(name, adapter)

    def replace_adapter_tensors(self, name, adapter):
        self._during()
        super().replace_adapter_tensors(name, adapter)

    def update_weights(self, named_tensors):
        self.updates += 1
        if self.updates == self.fail_at:
            raise EngineUnavailableError("connection lost in the middle of a merged update", engine=self.kind)
        super().update_weights(named_tensors)

    def _during(self) -> None:
        during, self.during = self.during, None
        if during is not None:
            during()


class Job:
    """One training job: its trainer, its Publisher (run), its version counter and its claims."""

    def __init__(self, model: Any, publisher: Publisher) -> None:
        self.model = model
        self.publisher = publisher
        self.version = 0
        self.good: tuple[str, dict[str, torch.Tensor]] | None = None  # what its last ok report says the engine serves
        self.seeds = 0

    def __repr__(self) -> str:
        return f"Job(run={self.publisher.run!r}, version={self.version})"


class PublisherMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="lorasync-machine-"))
        self.engine = MachineEngine(base_model_path=_base_dir())
        self.base = BaseWeights.from_pretrained(_base_dir())
        self.jobs: list[Job] = []
        self.mode = "ipc"
        self.last_writer: Job | None = None  # the job that changed the engine last (in place / merged: one shared slot)
        self.claim: tuple[Job, str, dict[str, torch.Tensor]] | None = None  # the last ok report's, while it must hold
        self.published: dict[str, list[dict[str, torch.Tensor]]] = {}  # served name -> every content published as it
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="machine-call")

    # -- setup and helpers -------------------------------------------------------------------------

    @initialize(mode=st.sampled_from(MODES))
    def start(self, mode: str) -> None:
        self.mode = mode
        self.jobs.append(self._job(seed=3))

    def _options(self) -> dict[str, Any]:
        common: dict[str, Any] = {"name": "p", "root": self.root, "keep": 2, "grace": 0.0}
        return common | {
            "ipc": {"transport": "ipc"},
            "disk": {"transport": "disk"},
            "in-place": {"in_place": True},
            "in-place-files": {"in_place": True, "transport": "disk"},
            "merged": {"transport": "merged", "base": self.base, "bucket_bytes": 1},
        }[self.mode]

    def _job(self, *, seed: int, run: str | None = None) -> Job:
        model = trainer(_base_dir(), seed=seed)
        return Job(model=model, publisher=Publisher([self.engine], run=run, **self._options()))

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in a worker thread, failing the test if it outlives the deadline."""
        future = self._pool.submit(fn, *args, **kwargs)
        try:
            return future.result(timeout=CALL_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise AssertionError(f"{getattr(fn, '__qualname__', fn)} hung for {CALL_TIMEOUT_S:.0f} s") from None

    def _served(self, name: str) -> dict[str, torch.Tensor]:
        return served_lora(self.engine, name)

    def _merged_as(self, tensors: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
        from lorasync import Adapter

        adapter = Adapter(tensors, export(model).config)
        return {f"{m}.weight": fold_module(adapter, m, self.base) for m in adapter.modules}

    def _engine_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        with self.engine._lock:
            params = dict(self.engine.model.named_parameters())
        return {n: next(p for k, p in params.items() if k == n or k.endswith(n.replace(".weight", ".base_layer.weight"))).detach().clone() for n in names}

    def check(self, job: Job, report: Any, tensors: dict[str, torch.Tensor], tokens: list[int]) -> None:
        """The invariant for one report: what each ok result names is served, exactly ``tensors``."""
        for result in report.results:
            if not result.ok:
                self._check_failed(job, result)
                continue
            assert report.content_hash == content_hash(tensors, job.model), f"{report.served_name}: the report's hash is not the published content's"
            if self.mode == "merged":
                expected = self._merged_as(tensors, job.model)
                held = self._engine_weights(sorted(expected))
                wrong = [n for n in expected if not torch.allclose(expected[n], held[n], rtol=0, atol=1e-6)]
                assert not wrong, f"{result.status}: the merged base is not W0 + s·B·A of the published content ({wrong[:2]})"
            else:
                assert result.served_name == report.served_name
                assert same(self._served(report.served_name), tensors), f"{result.status}: {report.served_name} does not serve the published bytes"
                assert self.engine.generate(PROMPT, adapter=report.served_name, max_new_tokens=4) == tokens
        if all(r.ok for r in report.results):
            job.good = (report.served_name, tensors)
            self.last_writer = job
            self.claim = (job, report.served_name, tensors)

    def _check_failed(self, job: Job, result: Any) -> None:
        error = result.error
        assert isinstance(error, LoraSyncError), f"untyped failure {error!r}"
        if "was put back" in str(error) and self.mode.startswith("in-place") and job.good is not None and self.last_writer is job:
            assert same(self._served(self.name_of(job)), job.good[1]), f"{error}: yet the previous version's bytes do not serve"
        if "unloaded" in str(error) and self.mode.startswith("in-place"):
            assert "p" not in self.engine.list_adapters()

    def _attempt(self, job: Job, tensors: dict[str, torch.Tensor]) -> None:
        """Remember ``tensors`` as content the engine may serve under this publish's name."""
        name = "p" if self.mode.startswith("in-place") else f"p@v{job.version}"
        self.published.setdefault(name, []).append(tensors)

    def name_of(self, job: Job) -> str:
        return "p" if self.mode.startswith("in-place") else (job.good[0] if job.good else "")

    def _publish(self, job: Job, *, probe: str, during: Any = None) -> None:
        job.version += 1
        tensors, tokens = state(job.model), greedy(job.model, PROMPT)
        verify = None
        if probe == "passing" and self.mode != "merged":  # merged folds differ from PEFT's by rounding: tokens only there
            verify = Probe.from_model(job.model, PROMPT, max_tokens=4)
        elif probe == "failing":
            verify = Probe(prompt_ids=PROMPT, expected_ids=[t ^ 1 for t in tokens])
        elif probe in ("erroring", "timing out"):  # a probe that would pass, but its generate call fails
            verify = Probe(prompt_ids=PROMPT, expected_ids=tokens)
            fault = EngineTimeoutError("did not answer within 0.5s (busy with rollouts)", engine="peft") if probe == "timing out" else EngineError("generate failed", engine="peft")
            self.engine.probe_fault = fault
        self.engine.during, self.claim = during, None
        self._attempt(job, tensors)
        before = self._snapshot()
        try:
            report = self.call(lambda: job.publisher.publish(export(job.model), version=job.version, verify=verify).settled(CALL_TIMEOUT_S))
        finally:
            self.engine.during = self.engine.probe_fault = None
        if probe in ("failing", "erroring", "timing out"):
            # Only a pass counts (invariant 11), "unchanged" included: never ok, never loaded, and
            # what served before serves still, exactly (the previous version back from its snapshot).
            result = report.results[0]
            assert not report.ok and (isinstance(result.error, VerificationError) or self._collided(job, result)), report
            after = self._snapshot()
            if self.mode.startswith("in-place") and "unloaded" in str(result.error):  # no copy of the previous version was kept: nothing serves
                assert "p" not in after, f"{probe} probe: {result.error}, yet p serves"
            else:
                assert after.keys() == before.keys() and all(same(after[k], before[k]) for k in before), (
                    f"{probe} probe: the engine does not serve what it served before ({sorted(before)} -> {sorted(after)}): {result.error}"
                )
            if isinstance(result.error, VerificationError):
                with pytest.raises(VerificationError):  # never leased
                    with job.publisher.lease(job.version):
                        pass
        self.check(job, report, tensors, tokens)

    def _collided(self, job: Job, result: Any) -> bool:
        """The other job already serves this version number or a newer one on the shared name:
        refused before anything moved (StaleVersionError), whatever the probe."""
        return isinstance(result.error, StaleVersionError) and any(j is not job and j.version >= job.version for j in self.jobs)

    def _snapshot(self) -> dict[str, dict[str, torch.Tensor]]:
        """Everything the engine serves under the adapter's names (merged: the base weights)."""
        if self.mode == "merged":
            with self.engine._lock:
                return {"base": {n: p.detach().clone() for n, p in self.engine.model.named_parameters() if ".lora_" not in n}}
        return {n: self._served(n) for n in self.engine.list_adapters() if re.fullmatch(r"p(@v\d+)?", n)}

    # -- rules ---------------------------------------------------------------------------------------

    @rule(data=st.data(), probe=st.sampled_from(["none", "none", "passing", "failing", "erroring", "timing out"]))
    def publish(self, data: st.DataObject, probe: str) -> None:
        self._publish(data.draw(st.sampled_from(self.jobs)), probe=probe)

    @rule(data=st.data())
    def train(self, data: st.DataObject) -> None:
        """An optimizer step after the export: the exported tensors change in place."""
        job = data.draw(st.sampled_from(self.jobs))
        job.seeds += 1
        step(job.model, seed=1000 + job.seeds)

    @precondition(lambda self: self.mode in ("ipc", "in-place"))
    @rule(data=st.data())
    def publish_while_training(self, data: st.DataObject) -> None:
        """A fused AdamW step lands while the engine copies the tensors in: refused, or exact."""
        job = data.draw(st.sampled_from(self.jobs))
        optimizer = torch.optim.AdamW(lora_params(job.model), lr=0.05, fused=True)

        def stepping() -> None:
            for p in lora_params(job.model):
                p.grad = torch.full_like(p, 0.01)
            optimizer.step()

        job.version += 1
        self.claim = None
        self.engine.during = stepping
        tensors, tokens = state(job.model), greedy(job.model, PROMPT)
        self._attempt(job, tensors)
        report = self.call(lambda: job.publisher.publish(export(job.model), version=job.version).settled(CALL_TIMEOUT_S))
        self.engine.during = None
        result = report.results[0]
        if result.ok:  # nothing loaded (identical content), or an owned copy was (in place, armed): the bytes before the step
            self.check(job, report, tensors, tokens)
        else:
            assert isinstance(result.error, AdapterChangedError) or self._collided(job, result), f"a step inside the load ended in {result.error!r}"
            self._check_failed(job, result)

    @precondition(lambda self: self.mode == "merged")
    @rule(data=st.data())
    def merged_update_fails_half_way(self, data: st.DataObject) -> None:
        """Bucket 2 of the next merge fails: the previous merge must be back, exactly."""
        job = data.draw(st.sampled_from(self.jobs))
        before = self._engine_weights([f"{m}.weight" for m in export(job.model).modules])
        self.engine.fail_at, self.claim = self.engine.updates + 2, None
        job.version += 1
        report = self.call(lambda: job.publisher.publish(export(job.model), version=job.version).settled(CALL_TIMEOUT_S))
        self.engine.fail_at = None
        if report.results[0].status == "unchanged":
            return
        assert isinstance(report.results[0].error, EngineUnavailableError), report
        after = self._engine_weights(sorted(before))
        assert all(torch.equal(before[n], after[n]) for n in before), "a failed merge left other weights than the previous merge"

    @rule()
    def restart_engine(self) -> None:
        """What a restart looks like to a client: every adapter is gone."""
        self.claim = None
        for name in self.engine.list_adapters():
            self.engine.unload_adapter(name)

    @rule(data=st.data(), resume=st.booleans())
    def restart_trainer(self, data: st.DataObject, resume: bool) -> None:
        """The trainer process restarts: a new Publisher, on its old run or a fresh one."""
        job = data.draw(st.sampled_from(self.jobs))
        run = job.publisher.run
        self.call(job.publisher.close)
        job.publisher = Publisher([self.engine], run=run if resume else None, **self._options())

    @precondition(lambda self: len(self.jobs) == 1)
    @rule()
    def second_job(self) -> None:
        """Another job starts on the same engine, store root and adapter name."""
        self.jobs.append(self._job(seed=4))

    @rule(data=st.data())
    def collect(self, data: st.DataObject) -> None:
        """Retire what drained, now: nothing the last report named stops serving."""
        job = data.draw(st.sampled_from(self.jobs))
        out = self.call(job.publisher.collect)
        assert set(out) >= {"retired", "deferred"}, out
        if self.claim is not None:
            assert self.claim[1] not in out["retired"], f"collect retired {self.claim[1]}, which the last report serves"

    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        """The trainer closes its publisher (and goes on with a new one on the same run): the
        closed one refuses further calls, typed and at once; what it published keeps serving."""
        job = data.draw(st.sampled_from(self.jobs))
        closed, run = job.publisher, job.publisher.run
        self.call(closed.close)
        self.call(closed.close)  # idempotent
        adapter = export(job.model)
        for call in (lambda: closed.publish(adapter, version=job.version + 1), closed.collect, lambda: closed.pin(job.version)):
            started = time.monotonic()
            try:
                self.call(call)
            except PublisherClosedError as exc:
                assert "closed" in str(exc), exc
            else:
                raise AssertionError("a closed publisher took a call")
            assert time.monotonic() - started < 10.0, "a closed publisher made a call wait"
        job.publisher = Publisher([self.engine], run=run, **self._options())

    @precondition(lambda self: hasattr(os, "fork"))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """A data-loader worker forks off the trainer and calls the publisher it inherited: refused
        with PublisherClosedError at once (never a hang, never the parent's run, loop or engine)."""
        job = data.draw(st.sampled_from(self.jobs))
        adapter = export(job.model)  # in the parent: the child runs no torch kernels after the fork
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                signal.alarm(int(CALL_TIMEOUT_S))
                out = {}
                for key, call in (("publish", lambda: job.publisher.publish(adapter, version=job.version + 1)), ("collect", job.publisher.collect)):
                    try:
                        call()
                        out[key] = "returned"
                    except LoraSyncError as exc:
                        out[key] = type(exc).__name__
                job.publisher.close()  # lets go of its copy only
                out["close"] = "returned"
                os.write(write, json.dumps(out).encode())
            finally:
                os._exit(0)
        os.close(write)
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        with os.fdopen(read, "rb") as pipe:
            out = json.loads(pipe.read() or b"{}")
        assert out == {"publish": "PublisherClosedError", "collect": "PublisherClosedError", "close": "returned"}, f"forked child: {out or 'hung or died'}"

    @rule(data=st.data(), turns=st.sampled_from([0, 1, 2, 3, 5, 8, 13, 21, 34, 55]))
    def cancelled_publish(self, data: st.DataObject, turns: int) -> None:
        """``apublish`` cancelled after ``turns`` event-loop turns (one ``asyncio.run`` a step, as
        many async trainers do). Whatever it left serves whole published content (the invariant),
        and the next publish of the job works as usual (the next rules check it)."""
        job = data.draw(st.sampled_from(self.jobs))
        job.version += 1
        self.claim = None
        tensors = state(job.model)
        self._attempt(job, tensors)

        async def cancelled() -> Any:
            task = asyncio.ensure_future(job.publisher.apublish(export(job.model), version=job.version))
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            try:
                report = await task
            except asyncio.CancelledError:
                return None
            return await asyncio.wait_for(report.asettled(), CALL_TIMEOUT_S)

        report = self.call(asyncio.run, cancelled())
        if report is not None:  # finished before the cancel arrived
            self.check(job, report, tensors, greedy(job.model, PROMPT))

    # -- invariants ----------------------------------------------------------------------------------

    @invariant()
    def every_served_name_holds_published_bytes(self) -> None:
        if self.mode == "merged":
            return  # the merge is checked against its reports and roll-backs
        for name in self.engine.list_adapters():
            if not re.fullmatch(r"p(@v\d+)?", name):
                continue
            held = self._served(name)
            assert any(same(held, sent) for sent in self.published.get(name, [])), f"{name} serves bytes no publish of it sent (torn, mixed or changed after export)"

    @invariant()
    def the_last_report_still_holds(self) -> None:
        if self.claim is None:
            return
        job, name, tensors = self.claim
        if self.mode == "merged":
            expected = self._merged_as(tensors, job.model)
            held = self._engine_weights(sorted(expected))
            assert all(torch.allclose(expected[n], held[n], rtol=0, atol=1e-6) for n in expected), "the merge changed under a report"
        else:
            assert same(self._served(name), tensors), f"{name} no longer serves what its report said"

    def teardown(self) -> None:
        try:
            for job in self.jobs:
                self.call(job.publisher.close)
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
            shutil.rmtree(self.root, ignore_errors=True)


PublisherMachine.TestCase.settings = settings(max_examples=10, stateful_step_count=10, deadline=None, suppress_health_check=list(HealthCheck))
test_publisher_state_machine = PublisherMachine.TestCase
