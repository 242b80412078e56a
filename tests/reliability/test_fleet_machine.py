"""A Hypothesis state machine over the Fleet, against the in-process PEFT engine (issue 33's
acceptance; the sibling of ``test_publisher_machine.py``).

The day it drives: tenants are registered, published in rounds (a no-copy export of each
trainer, sometimes while the trainer's optimizer steps in another thread: ``concurrent``),
verified with probes that pass, mismatch (another model's tokens) or error (the engine is busy
and its generate call fails), retired and registered again; the engine "restarts" (every adapter
gone) and a restore round follows; a second engine is added to the running fleet (each tenant's
current version restored onto it, then managed there by every later round).

Invariants, after every call and for every tenant:

* **every engine serves exactly the bytes its report says**: a tenant reported ``loaded``,
  ``unchanged`` or ``restored`` is listed under its served name, and what the engine serves there
  is one state of its trainer (never a mix of two optimizer steps), with the report's hash;
* **nothing unverified is reported served**: with a probe, a tenant is reported ``loaded`` only
  when every engine verified it; a probe that mismatches or errors leaves it ``failed`` and its
  new version served nowhere;
* a tenant's current version (``tenant.served_name``) is what every engine that lists it serves
  for it, with the tenant's hash, after every round;
* **no call hangs**: every call runs under a deadline.

To add a rule: write a ``@rule`` that drives ``self.fleet`` through :meth:`FleetMachine.call` and
checks each report with :meth:`FleetMachine.check`.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lorasync import Fleet, Probe
from lorasync.engines.peft import PeftEngine
from lorasync.errors import AdapterChangedError, EngineTimeoutError, LoraSyncError, VerificationError
from lorasync.exporters.fsdp import export

from ._trust import PROMPT, content_hash, lora_params, optimizer_step, same, served_lora, state, trainer
from .test_publisher_machine import _base_dir

CALL_TIMEOUT_S = 120.0
NAMES = ("a", "b")
PROBES = ("", "pass", "mismatch", "error")  # none, one recorded from the trainer, another model's, the engine errors
_TRAINERS: dict[str, Any] = {}


class BusyEngine(PeftEngine):
    """The PEFT engine; with ``busy`` armed its generate calls fail as a busy engine's time out."""

    busy = False

    def greedy(self, *args: Any, **kwargs: Any) -> Any:
        if self.busy:
            raise EngineTimeoutError("the engine is busy with rollouts: generate timed out", engine=self.kind)
        return super().greedy(*args, **kwargs)


class Trainer:
    """A tenant's trainer: its PEFT model, optimizer, and every state its LoRA tensors have had."""

    def __init__(self, name: str, seed: int) -> None:
        self.model = trainer(_base_dir(), seed=seed)
        self.optimizer = torch.optim.AdamW(lora_params(self.model), lr=0.05, foreach=True)
        self.seen = [state(self.model)]
        self.seed = seed * 1000

    def step(self) -> None:
        self.seed += 1
        optimizer_step(self.optimizer, self.model, seed=self.seed)
        self.seen.append(state(self.model))


def _trainer(name: str) -> Trainer:
    if name not in _TRAINERS:
        _TRAINERS[name] = Trainer(name, seed=len(_TRAINERS) + 1)
    return _TRAINERS[name]


class FleetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="lorasync-fleet-machine-"))
        self.engine = BusyEngine(base_model_path=_base_dir())
        self.engines: list[BusyEngine] = [self.engine]  # the first, and one added while running
        self.fleet = Fleet([self.engine], root=self.root)
        self.versions = dict.fromkeys(NAMES, 0)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleet-machine-call")
        self.other = trainer(_base_dir(), seed=77)  # a mismatching probe's model

    def teardown(self) -> None:
        try:
            self.call(self.fleet.close)
        finally:
            self._pool.shutdown(wait=False)
            for engine in self.engines:
                engine.close()
            shutil.rmtree(self.root, ignore_errors=True)

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return self._pool.submit(fn, *args, **kwargs).result(timeout=CALL_TIMEOUT_S)

    # -- checks ---------------------------------------------------------------------------------------

    def serves_one_state(self, name: str, served: str, digest: str | None, engine: BusyEngine | None = None) -> None:
        engine = engine or self.engine
        assert served in engine.list_adapters(), f"{served} is reported served but the engine does not list it"
        got = served_lora(engine, served)
        t = _trainer(name)
        assert any(same(got, s) for s in t.seen), f"{served} serves no single state of {name}'s trainer (a mix of two steps)"
        if digest is not None:
            assert content_hash(got, t.model) == digest, f"{served}: the reported hash is not the hash of what the engine serves"

    def check(self, report: Any, probes: dict[str, str]) -> None:
        for name, t in report.tenants.items():
            if t.status in ("loaded", "unchanged", "restored"):
                digest = t.publish.content_hash if t.publish is not None else None
                everywhere = all(r.ok for r in t.results)  # then every engine lists it; else those that do
                for engine in self.engines:
                    if everywhere or t.served_name in engine.list_adapters():
                        self.serves_one_state(name, t.served_name, digest, engine)
            if t.status == "loaded" and probes.get(name):
                assert all("verified through the engine" in r.reason for r in t.results if r.status == "loaded"), t
            if probes.get(name) in ("mismatch", "error"):
                assert t.status == "failed", f"{name}: a probe that {probes[name]}es was reported {t.status}"
                assert isinstance(t.error, LoraSyncError), t.error  # typed (an error: VerificationError once the probe's error is chained)
            if t.status == "failed" and (probes.get(name) or isinstance(t.error, (VerificationError, AdapterChangedError))):
                new = f"{name}@v{self.versions[name]}"
                if new != t.served_name:
                    for engine in self.engines:
                        assert new not in engine.list_adapters(), f"{new} failed ({type(t.error).__name__}) but serves"

    @invariant()
    def current_versions_serve_their_hash(self) -> None:
        for name, tenant in list(self.fleet.tenants.items()):
            for engine in self.engines:
                if tenant.version is not None and tenant.served_name in engine.list_adapters():
                    self.serves_one_state(name, tenant.served_name, tenant.content_hash, engine)

    # -- rules ----------------------------------------------------------------------------------------

    @rule(name=st.sampled_from(NAMES))
    def register(self, name: str) -> None:
        if name not in self.fleet.tenants:
            self.call(self.fleet.register, name, keep=1, grace=0.0)

    @precondition(lambda self: bool(self.fleet.tenants))
    @rule(data=st.data())
    def retire(self, data: Any) -> None:
        name = data.draw(st.sampled_from(sorted(self.fleet.tenants)))
        self.call(self.fleet.retire, name, timeout=0)
        assert not any(n.startswith(f"{name}@") for n in self.engine.list_adapters())

    @rule(name=st.sampled_from(NAMES))
    def train(self, name: str) -> None:
        _trainer(name).step()

    @precondition(lambda self: bool(self.fleet.tenants))
    @rule(data=st.data(), concurrent=st.booleans())
    def publish(self, data: Any, concurrent: bool) -> None:
        names = data.draw(st.lists(st.sampled_from(sorted(self.fleet.tenants)), min_size=1, unique=True))
        kinds = {n: data.draw(st.sampled_from(PROBES)) for n in names}
        for n in names:
            self.versions[n] += 1
        adapters = {n: export(_trainer(n).model) for n in names}  # no copy: the trainer's own tensors
        probes = {}
        for n, kind in kinds.items():
            if kind in ("pass", "error"):
                probes[n] = Probe.from_model(_trainer(n).model, PROMPT, max_tokens=2)
            elif kind == "mismatch":
                probes[n] = Probe.from_model(self.other, PROMPT, max_tokens=2)
        busy = any(k == "error" for k in kinds.values())
        for engine in self.engines:
            engine.busy = busy
        if busy:  # busy engines fail every probe of the round
            kinds = {n: ("error" if k else "") for n, k in kinds.items()}
        stop = threading.Event()
        steppers = [threading.Thread(target=self._keep_stepping, args=(n, stop), daemon=True) for n in names] if concurrent else []
        for s in steppers:
            s.start()
        try:
            report = self.call(self.fleet.publish, adapters, versions={n: self.versions[n] for n in names}, verify=probes)
        finally:
            stop.set()
            for s in steppers:
                s.join()
            for engine in self.engines:
                engine.busy = False
        if concurrent:  # a pass probe was recorded before the steps: it may rightly mismatch now
            kinds = {n: ("" if k == "pass" else k) for n, k in kinds.items()}
        self.check(report, kinds)

    @precondition(lambda self: bool(self.fleet.tenants))  # not on versions: whether a round served is not drawn data
    @rule()
    def restart_engine_and_restore(self) -> None:
        for served in self.engine.list_adapters():  # the first engine restarts: every adapter gone
            self.engine.unload_adapter(served)
        report = self.call(self.fleet.restore)
        self.check(report, {})
        for name, tenant in self.fleet.tenants.items():
            if tenant.version is not None and report.tenants.get(name) is not None and report[name].ok:
                assert tenant.served_name in self.engine.list_adapters()

    @precondition(lambda self: len(self.engines) == 1)
    @rule()
    def add_engine(self) -> None:
        added = BusyEngine(base_model_path=_base_dir())
        report = self.call(self.fleet.add_engine, added)
        self.engines.append(added)
        for name, t in report.tenants.items():
            if t.ok and self.fleet.tenants[name].version is not None:
                # Restored there from lorasync's own copy: exactly the tenant's current bytes.
                self.serves_one_state(name, self.fleet.tenants[name].served_name, self.fleet.tenants[name].content_hash, added)

    def _keep_stepping(self, name: str, stop: threading.Event) -> None:
        t = _trainer(name)
        while not stop.is_set():
            t.step()
            stop.wait(0.002)


FleetMachine.TestCase.settings = settings(max_examples=12, stateful_step_count=10, deadline=None, suppress_health_check=list(HealthCheck))
test_fleet_state_machine = FleetMachine.TestCase
