"""Only a verified version counts as served (issue 33 items 3 and 4; design invariant 11).

When a probe is given, any outcome other than a pass (a mismatch, the probe's generate call
erroring or timing out because the engine is busy with rollouts, the publish being cancelled
while it verifies) takes the new version out of service and puts the previous one back; nothing
unverified is recorded, reported ``unchanged`` later, or left loaded for retention to forget.

Real peer: the in-process PEFT engine, with one fault armed (its ``greedy`` raising a timeout, as
a busy engine's generate does, or blocking until cancelled); what it serves is read from its own
parameters and by generating through it. The real vLLM CPU server's twin is in
``tests/publish/test_vllm_verify.py``.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from lorasync import Probe, Publisher
from lorasync.engines.peft import PeftEngine
from lorasync.errors import EngineTimeoutError, EngineUnavailableError, VerificationError
from lorasync.exporters.fsdp import export

from ._trust import PROMPT, greedy, same, served_lora, state, step, trainer

MODES = {
    "ipc": {"transport": "ipc"},
    "disk": {"transport": "disk"},
    "in-place": {"in_place": True},
    "in-place-files": {"in_place": True, "transport": "disk"},
    "merged": {"transport": "merged"},
}


class BusyEngine(PeftEngine):
    """The PEFT engine; while ``busy``, its generate (the probe's) times out as a busy engine's
    does; ``block`` makes it wait for ``release`` instead (``entered`` says it started)."""

    busy = False
    block = False
    unload_fails: frozenset[str] = frozenset()  # names whose next unload fails (once each)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.entered, self.release = threading.Event(), threading.Event()

    def greedy(self, name, prompt_ids, max_tokens):
        if self.block:
            self.entered.set()
            self.release.wait(30)
        if self.busy:
            raise EngineTimeoutError("peft did not answer within 0.5s (busy with rollouts)", engine=self.kind)
        return super().greedy(name, prompt_ids, max_tokens)

    def unload_adapter(self, name):
        if name in self.unload_fails:
            self.unload_fails -= {name}
            raise EngineUnavailableError("connection lost while unloading", engine=self.kind)
        super().unload_adapter(name)


def _passing(model) -> Probe:
    return Probe.from_model(model, PROMPT, max_tokens=4)


def _tokens_probe(model) -> Probe:
    """Greedy tokens only (a merge's fold differs from PEFT's by rounding: logprobs would not pass)."""
    return Probe(prompt_ids=PROMPT, expected_ids=greedy(model, PROMPT))


def _failing(model) -> Probe:
    return Probe(prompt_ids=PROMPT, expected_ids=[t ^ 1 for t in greedy(model, PROMPT)])


def _publisher(engine, mode: str, tmp_path, tiny_model_dir, **options) -> Publisher:
    extra = {"base": tiny_model_dir} if mode == "merged" else {}
    return Publisher([engine], name="p", root=tmp_path, **MODES[mode], **extra, **options)


def _base_weights(engine) -> dict[str, torch.Tensor]:
    with engine._lock:
        return {n: p.detach().clone() for n, p in engine.model.named_parameters() if ".lora_" not in n}


class Served:
    """What the engine serves for the publisher's adapter, read from the engine itself."""

    def __init__(self, engine: BusyEngine, mode: str) -> None:
        self.engine, self.mode = engine, mode

    def snapshot(self) -> dict:
        if self.mode == "merged":
            return {"base": _base_weights(self.engine)}
        if self.mode.startswith("in-place"):
            return {"p": served_lora(self.engine, "p")}
        return {n: served_lora(self.engine, n) for n in self.engine.list_adapters() if n.startswith("p@")}

    def tokens(self, served: str | None) -> list[int]:
        return self.engine.generate(PROMPT, adapter=served, max_new_tokens=4)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def _served_name(mode: str, version: int) -> str | None:
    return None if mode == "merged" else ("p" if mode.startswith("in-place") else f"p@v{version}")


@pytest.mark.parametrize("mode", list(MODES))
def test_a_probe_that_errors_leaves_the_previous_version_serving(mode, tiny_model_dir, tmp_path):
    """Item 3: v2's probe cannot run (the engine is busy: its generate times out). The publish
    fails, and the engine serves v1 again, exactly: in place ``p``, merged the base, versioned
    only ``p@v1``."""
    model = trainer(tiny_model_dir)
    engine = BusyEngine(base_model_path=tiny_model_dir)
    served = Served(engine, mode)
    probe = _tokens_probe if mode == "merged" else _passing
    with _publisher(engine, mode, tmp_path, tiny_model_dir) as pub:
        v1_tokens = greedy(model, PROMPT)
        assert pub.publish(export(model), version=1, verify=probe(model)).ok
        before = served.snapshot()
        step(model, seed=31)
        engine.busy = True
        report = pub.publish(export(model), version=2, verify=probe(model))
        engine.busy = False
        error = report.results[0].error
        assert not report.ok, report
        assert _equal(served.snapshot(), before), f"{error}: yet the engine does not serve v1 again"
        assert served.tokens(_served_name(mode, 1)) == v1_tokens
        assert isinstance(error, VerificationError) and isinstance(error.__cause__, EngineTimeoutError), repr(error)
        with pytest.raises(VerificationError, match="did not pass its verification"):  # never leased
            with pub.lease(2):
                pass


@pytest.mark.parametrize("mode", list(MODES))
def test_a_publish_retried_after_its_probe_errored_is_verified_again_never_unchanged(mode, tiny_model_dir, tmp_path):
    """Item 4: v2's probe errored; the same publish again, with a probe the engine does not
    reproduce, must fail verification (it was reported ``unchanged``, ok, never verified). Then
    with a probe that passes, v2 loads, verified."""
    model = trainer(tiny_model_dir)
    engine = BusyEngine(base_model_path=tiny_model_dir)
    served = Served(engine, mode)
    probe = _tokens_probe if mode == "merged" else _passing
    with _publisher(engine, mode, tmp_path, tiny_model_dir) as pub:
        assert pub.publish(export(model), version=1, verify=probe(model)).ok
        before = served.snapshot()
        step(model, seed=32)
        engine.busy = True
        assert not pub.publish(export(model), version=2, verify=probe(model)).ok
        engine.busy = False
        again = pub.publish(export(model), version=2, verify=_failing(model))
        result = again.results[0]
        assert result.status == "failed" and isinstance(result.error, VerificationError), f"{result.status}: {result.reason or result.error}"
        assert _equal(served.snapshot(), before)
        verified = pub.publish(export(model), version=2, verify=probe(model))
        assert verified.ok and verified.results[0].status == "loaded", verified
        assert "verified" in verified.results[0].reason
        assert served.tokens(_served_name(mode, 2)) == greedy(model, PROMPT)
        with pub.lease(2) as name:
            assert name == (_served_name(mode, 2) or "p@v2")


@pytest.mark.parametrize("unload_fails", [False, True])
def test_versions_whose_verification_errored_never_stay_loaded(unload_fails, tiny_model_dir, tmp_path):
    """Item 4: with keep=1, v0 verified, then v1..v5 whose probes error (and, second case, whose
    withdrawal's unload fails once too): none of them stays loaded, during the run or after
    close(); v0 serves throughout."""
    model = trainer(tiny_model_dir)
    engine = BusyEngine(base_model_path=tiny_model_dir)
    v0, v0_tokens = state(model), greedy(model, PROMPT)
    with Publisher([engine], name="p", root=tmp_path, transport="ipc", keep=1, grace=0.0) as pub:
        assert pub.publish(export(model), version=0, verify=_passing(model)).ok
        for version in range(1, 6):
            step(model, seed=40 + version)
            engine.busy, engine.unload_fails = True, frozenset({f"p@v{version}"} if unload_fails else ())
            report = pub.publish(export(model), version=version, verify=_passing(model))
            engine.busy, engine.unload_fails = False, frozenset()
            error = report.results[0].error
            assert isinstance(error, VerificationError), report
            assert ("failed too" in str(error)) == unload_fails, str(error)
            report.settled(60)
            loaded = [n for n in engine.list_adapters() if n.startswith("p@")]
            # A withdrawal that failed is retried by the next publish (before it loads anything).
            assert set(loaded) <= {"p@v0", f"p@v{version}"} and "p@v0" in loaded, loaded
            assert same(served_lora(engine, "p@v0"), v0)
        pub.collect()
        assert [n for n in engine.list_adapters() if n.startswith("p@")] == ["p@v0"]
    assert [n for n in engine.list_adapters() if n.startswith("p@")] == ["p@v0"]
    assert engine.generate(PROMPT, adapter="p@v0", max_new_tokens=4) == v0_tokens


@pytest.mark.parametrize("mode", list(MODES))
def test_a_publish_cancelled_while_it_verifies_leaves_the_previous_version_serving(mode, tiny_model_dir, tmp_path):
    """Cancellation at the verify await: the probe's generate has started when the trainer's task
    is cancelled. The new version never counts as served: the previous one serves, and the same
    publish afterwards loads and verifies again."""
    model = trainer(tiny_model_dir)
    engine = BusyEngine(base_model_path=tiny_model_dir)
    served = Served(engine, mode)
    probe = _tokens_probe if mode == "merged" else _passing
    with _publisher(engine, mode, tmp_path, tiny_model_dir) as pub:
        v1_tokens = greedy(model, PROMPT)
        assert pub.publish(export(model), version=1, verify=probe(model)).ok
        before = served.snapshot()
        step(model, seed=33)

        async def cancelled() -> None:
            engine.block = True
            engine.entered.clear()
            engine.release.clear()
            task = asyncio.ensure_future(pub.apublish(export(model), version=2, verify=probe(model)))
            while not engine.entered.is_set():
                assert not task.done(), task
                await asyncio.sleep(0.01)
            task.cancel()
            engine.block = False
            threading.Timer(0.2, engine.release.set).start()  # the generate ends later, as a real one would
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(cancelled())
        assert _equal(served.snapshot(), before), "a publish cancelled while verifying left its unverified weights serving"
        assert served.tokens(_served_name(mode, 1)) == v1_tokens
        again = pub.publish(export(model), version=2, verify=_failing(model))
        assert isinstance(again.results[0].error, VerificationError), again
        assert pub.publish(export(model), version=2, verify=probe(model)).results[0].status == "loaded"


@pytest.mark.parametrize("mode", list(MODES))
def test_unchanged_content_is_reported_served_only_after_the_probe_passes(mode, tiny_model_dir, tmp_path):
    """Item 4 (the state machine's old exemption): identical content published again with a probe
    is ``unchanged`` only once the engine reproduces it; a probe it does not reproduce, or one
    that cannot run, fails the publish, and what served stays as it was."""
    model = trainer(tiny_model_dir)
    engine = BusyEngine(base_model_path=tiny_model_dir)
    served = Served(engine, mode)
    probe = _tokens_probe if mode == "merged" else _passing
    with _publisher(engine, mode, tmp_path, tiny_model_dir) as pub:
        assert pub.publish(export(model), version=1).ok  # no probe: served on the report's word
        before = served.snapshot()
        assert not pub.publish(export(model), version=2, verify=_failing(model)).ok
        engine.busy = True
        assert not pub.publish(export(model), version=2, verify=probe(model)).ok
        engine.busy = False
        assert _equal(served.snapshot(), before)
        report = pub.publish(export(model), version=2, verify=probe(model))
        assert report.ok and report.results[0].status == "unchanged" and "verified" in report.results[0].reason, report
