"""Retirement off the critical path: ``publish`` returns once the new version serves; re-listing,
unloading old versions and collecting files follow in the background, are still reported, and
never race the next publish (issue 16)."""

import asyncio
import threading
import time

from lorasync import Publisher, Retention
from lorasync.testing import MemoryEngine
from tests.support.adapters import tiny_adapter

UNLOAD_S = 1.0  # long beside a publish of a tiny adapter, even on a busy 2-core box (two pytest workers)
adapter = tiny_adapter


class SlowUnload(MemoryEngine):
    """Unloads take UNLOAD_S (a busy server); every load and unload is logged with its span."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[tuple[str, str, float, float]] = []
        self._guard = threading.Lock()

    def _log(self, op: str, name: str, start: float) -> None:
        with self._guard:
            self.spans.append((op, name, start, time.monotonic()))

    def load_adapter(self, name, path):
        start = time.monotonic()
        super().load_adapter(name, path)
        self._log("load", name, start)

    def unload_adapter(self, name):
        start = time.monotonic()
        time.sleep(UNLOAD_S)
        super().unload_adapter(name)
        self._log("unload", name, start)


def on_disk(pub: Publisher) -> list[int]:
    return pub.store.versions(pub.name)


def test_publish_returns_before_the_retirement_which_is_reported_once_settled(tmp_path):
    engine = SlowUnload()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path, grace=0.0)
    pub.publish(adapter(1), version=1).settled()
    start = time.monotonic()
    report = pub.publish(adapter(2), version=2)
    returned = time.monotonic() - start
    assert report.ok and report.served_name == "p@v2"
    assert "p@v2" in engine.list_adapters()  # serving when publish returned
    assert returned < UNLOAD_S  # the slow unload of v1 was not on the critical path
    assert report.settled() is report
    assert report.results[0].retired == ["p@v1"] and "retire" in report.results[0].timings and "gc" in report.timings
    assert engine.list_adapters() == ["p@v2"] and on_disk(pub) == [2]
    pub.close()


def test_the_next_publish_waits_for_the_previous_retirement(tmp_path):
    engine = SlowUnload()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path, grace=0.0)
    reports = [pub.publish(adapter(v), version=v) for v in range(1, 6)]  # never settled by hand
    pub.close()
    # Each load started only after the unload the previous publish left running had finished.
    spans = engine.spans
    for i, (op, name, begin, _) in enumerate(spans):
        if op == "load":
            assert all(end <= begin for o, _, _, end in spans[:i] if o == "unload"), spans
    assert [r.results[0].retired for r in reports] == [[], ["p@v1"], ["p@v2"], ["p@v3"], ["p@v4"]]
    assert engine.list_adapters() == ["p@v5"] and on_disk(pub) == [5]


def test_asyncio_run_per_step_still_retires(tmp_path):
    # The caller's loop ends after every step, cancelling what a publish left running on it:
    # the next publish redoes the retirement, and close() does the last one.
    engine = MemoryEngine()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path, grace=0.0)
    for v in range(1, 5):
        assert asyncio.run(pub.apublish(adapter(v), version=v)).ok
        assert len(engine.list_adapters()) <= 2  # never more than one step behind
    pub.close()
    assert engine.list_adapters() == ["p@v4"] and on_disk(pub) == [4]


def test_background_false_retires_before_publish_returns(tmp_path):
    engine = SlowUnload()
    pub = Publisher([engine], name="p", root=tmp_path, grace=0.0, retention=Retention(keep=1, grace=0.0, background=False))
    pub.publish(adapter(1), version=1)
    start = time.monotonic()
    report = pub.publish(adapter(2), version=2)
    assert time.monotonic() - start >= UNLOAD_S
    assert report.results[0].retired == ["p@v1"] and engine.list_adapters() == ["p@v2"]
    pub.close()


def test_settled_inside_the_loop_that_runs_it_says_what_to_do(tmp_path):
    engine = MemoryEngine()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path)

    async def steps() -> str:
        await pub.apublish(adapter(1), version=1)
        report = await pub.apublish(adapter(2), version=2)
        try:
            report.settled()
        except RuntimeError as exc:
            message = str(exc)
        await report.asettled()
        assert report.results[0].retired == ["p@v1"]
        await pub.aclose()
        return message

    assert "await report.asettled()" in asyncio.run(steps())


def test_a_stuck_retirement_never_holds_the_next_publish(tmp_path, monkeypatch):
    import lorasync.publisher._aftercare as aftercare

    monkeypatch.setattr(aftercare, "SETTLE_WAIT_S", 0.3)
    release = threading.Event()

    class StuckOnce(MemoryEngine):
        stuck = True

        def unload_adapter(self, name):
            if self.stuck:
                self.stuck = False
                release.wait(30)  # an unload call that does not come back
            super().unload_adapter(name)

    engine = StuckOnce()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path, grace=0.0)
    pub.publish(adapter(1), version=1)
    pub.publish(adapter(2), version=2)  # its retirement of v1 hangs in the background
    start = time.monotonic()
    report = pub.publish(adapter(3), version=3).settled()
    assert time.monotonic() - start < 5
    assert report.ok and "p@v3" in engine.list_adapters()
    release.set()
    pub.collect()
    assert engine.list_adapters() == ["p@v3"]
    pub.close()


def test_an_engine_the_caller_drives_itself_retires_before_publish_returns(tmp_path):
    # A sync vllm.LLM in the trainer's process: lorasync must never call it while the caller does.
    import dataclasses

    class Exclusive(SlowUnload):
        def capabilities(self):
            return dataclasses.replace(super().capabilities(), concurrent_calls=False)

    engine = Exclusive()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path, grace=0.0)
    pub.publish(adapter(1), version=1)
    start = time.monotonic()
    report = pub.publish(adapter(2), version=2)
    assert time.monotonic() - start >= UNLOAD_S  # unloaded before returning
    assert report.results[0].retired == ["p@v1"] and engine.list_adapters() == ["p@v2"]
    pub.close()
