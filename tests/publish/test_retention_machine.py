"""Hypothesis state machine over what a trainer's day does to retention: publish, requests that
start and end on any loaded version, pins, close and re-open, and engine restarts.

Invariants after every step: no request ever runs on files that are gone (the engine re-reads them
every step, as vLLM does for an evicted adapter), nor on an unloaded adapter unless the deferral
bound forced it out with a ``RetentionWarning``; every adapter the engine lists still has its
files; never more versions loaded than the bound (keep + pinned + max_deferred, plus the one being
published)."""

from __future__ import annotations

import shutil
import tempfile
import warnings

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lorasync import Adapter, AdapterConfig, Publisher, RetentionWarning

from ._inflight import ReloadingEngine

M = "model.layers.0.self_attn.v_proj"
KEEP, MAX_DEFERRED = 2, 3


def _adapter(seed: int) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    return Adapter(
        {f"base_model.model.{M}.lora_A.weight": torch.randn(2, 16, generator=g), f"base_model.model.{M}.lora_B.weight": torch.randn(16, 2, generator=g)},
        AdapterConfig(r=2, lora_alpha=4),
    )


class RetentionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="lorasync-machine-")
        self.engine = ReloadingEngine()
        self.pub = self._publisher()
        self.version = 0
        self.pins: list[int] = []
        self.forced: set[str] = set()

    def _publisher(self, run: str | None = None) -> Publisher:
        # drain_timeout=None: nothing is ever forced out, so any violation is a real bug.
        return Publisher([self.engine], name="p", keep=KEEP, max_deferred=MAX_DEFERRED, drain_timeout=None, grace=0.0, root=self.root, run=run)

    def loaded(self) -> list[str]:
        return self.engine.list_adapters()

    @rule(seed=st.integers(0, 5))
    def publish(self, seed: int) -> None:
        self.version += 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RetentionWarning)
            report = self.pub.publish(_adapter(seed), version=self.version).settled()  # its retirement warns here too
        assert report.ok, report
        # Past max_deferred the oldest waiting version is unloaded anyway, with a typed warning:
        # its requests keep decoding from its files, which must still be there.
        for warning in caught:
            assert issubclass(warning.category, RetentionWarning)
            self.forced.add(str(warning.message).split(" ", 1)[0])

    @precondition(lambda self: self.loaded())
    @rule(data=st.data())
    def start_request(self, data: st.DataObject) -> None:
        self.engine.start(data.draw(st.sampled_from(sorted(self.loaded()))))

    @precondition(lambda self: self.engine.running)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        self.engine.finish(data.draw(st.sampled_from(sorted(self.engine.running))))

    @rule()
    def step(self) -> None:
        self.engine.step()

    @precondition(lambda self: self.version > 0)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        version = data.draw(st.integers(1, self.version))
        self.pub.pin(version)
        self.pins.append(version)

    @precondition(lambda self: self.pins)
    @rule()
    def unpin(self) -> None:
        self.pub.unpin(self.pins.pop(0))

    @rule()
    def collect(self) -> None:
        self.pub.collect()

    @rule()
    def close_and_resume(self) -> None:
        run = self.pub.run
        self.pub.close()
        self.pub = self._publisher(run=run)
        for version in self.pins:
            self.pub.pin(version)

    @rule()
    def restart_engine(self) -> None:
        self.engine.restart()

    @invariant()
    def no_request_lost_its_adapter(self) -> None:
        self.engine.step()
        lost = [v for v in self.engine.violations if not (v.endswith("adapter unloaded while it ran") and v.split(" on ", 1)[1].split(":")[0] in self.forced)]
        assert lost == []

    @invariant()
    def every_listed_adapter_has_its_files(self) -> None:
        for name in self.loaded():
            path = self.engine.path_of(name)
            assert path is None or shutil.os.path.isfile(f"{path}/adapter_model.safetensors"), name

    @invariant()
    def loaded_versions_are_bounded(self) -> None:
        assert len(self.loaded()) <= KEEP + len(set(self.pins)) + MAX_DEFERRED + 1

    def teardown(self) -> None:
        self.pub.close()
        shutil.rmtree(self.root, ignore_errors=True)


RetentionMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_retention_state_machine = RetentionMachine.TestCase
