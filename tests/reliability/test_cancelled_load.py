"""A publish after a cancelled one whose engine call still runs (issue 33 item 15).

Cancelling ``apublish`` mid-load releases the publisher's lock at once, but the engine call runs
on in its thread: on the in-process PEFT engine it holds the engine's lock (every engine call
takes it), so the next publish's first listing waited for as long as the cancelled load lasted
(past 10 s on a loaded box). The engine handle now remembers that call: the next publish gives it
a bounded wait, then reports that engine failed with ``EngineTimeoutError`` (the previous version
still serving); once the call finished, what it loaded and nobody recorded is unloaded again.

Real PEFT engine; only its load is slowed (``_load_validated`` sleeps for the cancelled version).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from lorasync import Publisher
from lorasync.publisher import _cancelled
from lorasync.errors import EngineTimeoutError
from lorasync.testing import make_tiny_model, tiny_llama_adapter
from tests.reliability._trust import same, served_lora
from tests.reliability.test_trust_lifecycle import bounded


def _engine(slow_s: float) -> Any:
    from lorasync.engines.peft import PeftEngine

    class SlowPeft(PeftEngine):
        """The real PEFT engine whose load of ``p@v1`` takes ``slow_s`` (under the engine's lock)."""

        loading = threading.Event()
        loaded = threading.Event()

        def _load_validated(self, name: str, adapter: Any) -> None:
            if name == "p@v1":
                self.loading.set()
                time.sleep(slow_s)
            super()._load_validated(name, adapter)
            if name == "p@v1":
                self.loaded.set()

    return SlowPeft(make_tiny_model(seed=0))


def _adapter(version: int) -> Any:
    return tiny_llama_adapter(seed=version)


async def _cancel_mid_load(pub: Publisher, engine: Any) -> None:
    """Start publishing v1 and cancel it while the engine loads it."""
    task = asyncio.ensure_future(pub.apublish(_adapter(1), version=1))
    while not engine.loading.is_set():
        assert not task.done(), task
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def _serves_exactly(engine: Any, expected: dict[int, Any]) -> None:
    """The engine lists exactly ``p@v<k>`` for the versions given, each with its exact tensors."""
    assert sorted(n for n in engine.list_adapters() if n.startswith("p@")) == sorted(f"p@v{v}" for v in expected)
    for version, adapter in expected.items():
        assert same(served_lora(engine, f"p@v{version}"), dict(adapter.tensors)), f"p@v{version} does not serve its own tensors"


def test_a_publish_after_a_cancelled_load_waits_for_it_then_unloads_what_it_left(tmp_path):
    # The cancelled load (2 s) ends within the bound: the next publish waits for it, takes out
    # the p@v1 it loaded (cancelled: nobody recorded it) and publishes v2.
    engine = _engine(2.0)
    pub = Publisher([engine], name="p", keep=2, root=tmp_path, grace=0.0)

    async def trainer() -> tuple[Any, float]:
        await (await pub.apublish(_adapter(0), version=0)).asettled()
        await _cancel_mid_load(pub, engine)
        t0 = time.monotonic()
        report = await asyncio.wait_for(pub.apublish(_adapter(2), version=2), _cancelled.CANCELLED_CALL_WAIT_S + 10)
        waited = time.monotonic() - t0
        await report.asettled()
        return report, waited

    report, waited = bounded(asyncio.run, trainer(), what="the publish after a cancelled load")
    assert report.ok, report
    assert engine.loaded.is_set()
    assert waited < _cancelled.CANCELLED_CALL_WAIT_S + 5, waited
    _serves_exactly(engine, {0: _adapter(0), 2: _adapter(2)})  # no p@v1: it was cancelled
    pub.close()


def test_a_publish_after_a_cancelled_load_that_outlasts_the_bound_fails_typed_and_keeps_the_previous(tmp_path, monkeypatch):
    monkeypatch.setattr(_cancelled, "CANCELLED_CALL_WAIT_S", 0.5)
    engine = _engine(4.0)
    pub = Publisher([engine], name="p", keep=2, root=tmp_path, grace=0.0)

    async def trainer() -> tuple[Any, float]:
        await (await pub.apublish(_adapter(0), version=0)).asettled()
        await _cancel_mid_load(pub, engine)
        t0 = time.monotonic()
        # Never past the bound (plus slack for a loaded box), never the length of the load.
        report = await asyncio.wait_for(pub.apublish(_adapter(2), version=2), 3.0)
        return report, time.monotonic() - t0

    report, waited = bounded(asyncio.run, trainer(), what="the publish after a cancelled load")
    assert not report.ok and waited < 3.0, (report, waited)
    error = report.results[0].error
    assert isinstance(error, EngineTimeoutError), report
    assert "cancelled load of p v1" in str(error) and "retry" in str(error), error
    # The previous version still serves, exactly; v2 was never loaded.
    assert "p@v2" not in engine.list_adapters()  # waits for the engine's lock: the slow load ends first
    assert same(served_lora(engine, "p@v0"), dict(_adapter(0).tensors))
    # Once the cancelled load finished, the next publish takes out the p@v1 it left behind.
    assert engine.loaded.wait(10)
    report = bounded(pub.publish, _adapter(3), version=3, what="the publish once the cancelled load finished")
    assert report.ok, report
    report.settled()
    _serves_exactly(engine, {0: _adapter(0), 3: _adapter(3)})
    pub.close()


def test_a_sync_publish_from_a_thread_after_a_cancelled_apublish(tmp_path):
    # The trainer's loop cancelled the publish and ended; the next step publishes from a thread
    # (the publisher's own loop), where the cancelled call is remembered all the same.
    engine = _engine(2.0)
    pub = Publisher([engine], name="p", keep=2, root=tmp_path, grace=0.0)
    pub.publish(_adapter(0), version=0).settled()

    bounded(asyncio.run, _cancel_mid_load(pub, engine), what="the cancelled apublish")
    t0 = time.monotonic()
    report = bounded(pub.publish, _adapter(2), version=2, what="the sync publish after a cancelled apublish")
    waited = time.monotonic() - t0
    assert report.ok, report
    assert waited < _cancelled.CANCELLED_CALL_WAIT_S + 5, waited
    report.settled()
    _serves_exactly(engine, {0: _adapter(0), 2: _adapter(2)})
    pub.close()
