"""Slots an unload does not free (vLLM #54839: the unload drops only the frontend's entry).

Two fake engines whose unload answers success and frees nothing: one keeps listing the adapter,
one drops it from its list but still holds it in its own LoRA list (``aheld_adapters``, as the
in-process vLLM engine reports vLLM's ``list_loras``). lorasync must notice after retiring
versions, warn with the remedy, keep the files the engine may still read, and never take the
serving version down to make room that the engine will not really free.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from lorasync import Publisher
from lorasync.errors import CapacityError, SlotLeakWarning
from lorasync.testing import MemoryEngine
from tests.support.adapters import tiny_adapter


class ListingLeak(MemoryEngine):
    """Unload answers OK and the adapter stays loaded and listed; like vLLM, it may re-read an
    adapter's files (so they are kept for a grace period after an unload)."""

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            self._enter("unload_adapter")

    def _caps(self):
        return dataclasses.replace(super()._caps(), reloads_from_path=True)


class HiddenLeak(MemoryEngine):
    """Unload drops the name from the list only; the engine still holds the adapter (and its slot)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hidden: set[str] = set()

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            self._enter("unload_adapter")
            self.hidden.add(name)

    def list_adapters(self) -> list[str]:
        return [n for n in super().list_adapters() if n not in self.hidden]

    async def aheld_adapters(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._adapters)


def _publish(pub: Publisher, version: int):
    return pub.publish(tiny_adapter(seed=version), version=version).settled()


def test_an_unload_that_leaves_the_adapter_listed_is_reported(tmp_path: Path) -> None:
    """v2's publish retires v1 after it serves; the next listing (v3's publish) finds v1 still
    there: one SlotLeakWarning with the remedy, and v1's files stay (the engine may read them)."""
    engine = ListingLeak()
    pub = Publisher([engine], name="pol", keep=1, transport="disk", root=tmp_path, grace=30.0)
    try:
        assert _publish(pub, 1).ok
        assert _publish(pub, 2).ok
        with pytest.warns(SlotLeakWarning, match=r"pol@v1.*still lists.*vLLM #54839") as caught:
            assert _publish(pub, 3).ok
        leaks = [w.message for w in caught if isinstance(w.message, SlotLeakWarning)]
        assert [leak.adapters for leak in leaks] == [("pol@v1",)] and leaks[0].engine == "memory"
        assert (pub.store.path_for("pol", 1) / "adapter_model.safetensors").is_file()
        assert 1 in pub._files.held()  # held again: no grace runs out under the engine
        with warnings.catch_warnings(record=True) as later:
            warnings.simplefilter("always")
            assert _publish(pub, 4).ok
        # Each leaked name is reported once: v1 not again, v2 (retired by v3's publish) now.
        assert [w.message.adapters for w in later if isinstance(w.message, SlotLeakWarning)] == [("pol@v2",)]
    finally:
        pub.close()


def test_capacity_never_counts_on_a_slot_the_engine_still_holds(tmp_path: Path) -> None:
    """keep=1 on 3 slots, unloads free nothing: v1 and v2 stay held. For v4 the planner sees the
    engine full (v1, v2 held, v3 serving) and refuses before anything moves, so v3 keeps serving;
    counting on v3's unload would take v3 down and then fail the load."""
    engine = HiddenLeak(max_loras=3)
    pub = Publisher([engine], name="pol", keep=1, transport="ipc", root=tmp_path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SlotLeakWarning)
            for version in (1, 2, 3):
                assert _publish(pub, version).ok
        assert engine.list_adapters() == ["pol@v3"] and set(engine.adapters) == {"pol@v1", "pol@v2", "pol@v3"}
        report = pub.publish(tiny_adapter(seed=4), version=4)
        assert not report.ok
        error = report.results[0].error
        assert isinstance(error, CapacityError), error
        assert "still holds pol@v1, pol@v2" in str(error) and "nothing was unloaded" in str(error)
        assert engine.list_adapters() == ["pol@v3"]  # still serving
        assert "pol@v3" not in engine.hidden
    finally:
        pub.close()


def test_an_engine_that_frees_its_slots_raises_no_warning(tmp_path: Path) -> None:
    engine = MemoryEngine(max_loras=2)
    pub = Publisher([engine], name="pol", keep=1, transport="ipc", root=tmp_path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", SlotLeakWarning)
            for version in range(1, 5):
                assert _publish(pub, version).ok
        assert engine.list_adapters() == ["pol@v4"]
    finally:
        pub.close()


def test_a_version_forced_out_while_its_requests_run_is_no_leak_until_they_end() -> None:
    # Retention unloads a version by force while requests still use it (max_deferred,
    # drain_timeout): the engine serving them on is the forced unload itself, already told by a
    # RetentionWarning, not a slot it kept. A name unloaded normally that still shows requests at
    # two checks in a row is reported as before; so is a forced one the engine still lists.
    import asyncio

    from lorasync.publisher._leaks import SlotLeaks

    leaks = SlotLeaks(MemoryEngine(), "engine")
    leaks.forced_out(["p@v1"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for busy in ({"p@v1", "p@v2"}, {"p@v1", "p@v2"}, {"p@v1", "p@v2"}):
            held = asyncio.run(leaks.check(["p@v1", "p@v2"], listed=[], busy=busy))
            assert held == frozenset()
    reported = [w for w in caught if issubclass(w.category, SlotLeakWarning)]
    assert [w.message.adapters for w in reported] == [("p@v2",)]
    assert {"p@v1", "p@v2"} <= leaks.suspects  # both occupy a slot while their requests run
    asyncio.run(leaks.check(listed=[], busy=set()))  # the forced one's requests ended
    assert "p@v1" not in leaks.suspects and "p@v1" in leaks.freed
    leaks.forced_out(["p@v3"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert asyncio.run(leaks.check(["p@v3"], listed=["p@v3"], busy={"p@v3"})) == {"p@v3"}
    assert [w.message.adapters for w in caught if issubclass(w.category, SlotLeakWarning)] == [("p@v3",)]


def test_a_version_forced_out_under_a_request_never_refuses_a_publish_the_engine_has_room_for(tmp_path: Path) -> None:
    # Counted occupied while its request runs, but no sign that the engine's unloads free nothing:
    # the retiring version may still go early to make room (found by an outside attack).
    engine = MemoryEngine(max_loras=2)
    pub = Publisher([engine], name="pol", keep=1, transport="ipc", root=tmp_path, max_deferred=0, drain_timeout=None, grace=0.0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert pub.publish(tiny_adapter(seed=1), version=1).settled().ok
            with engine.request("pol@v1"):  # a long rollout on v1; v2's retirement forces it out
                for version in (2, 3):
                    assert pub.publish(tiny_adapter(seed=version), version=version).settled().ok
                assert engine.list_adapters() == ["pol@v3"]
                report = pub.publish(tiny_adapter(seed=4), version=4).settled()
                assert report.ok, report.results[0].error
                assert engine.list_adapters() == ["pol@v4"]
                assert engine._adapters["pol@v4"].content_hash == tiny_adapter(seed=4).content_hash
        assert not [w for w in caught if issubclass(w.category, SlotLeakWarning)]
    finally:
        pub.close()


class FlakyMetrics(MemoryEngine):
    """Reports requests in flight, except that a read fails when told to (``/metrics`` timing out)."""

    fail = 0

    def adapters_in_use(self):
        if self.fail:
            self.fail -= 1
            from lorasync.errors import EngineError

            raise EngineError("GET /metrics timed out")
        return super().adapters_in_use()


def test_one_unknown_reading_of_requests_does_not_forget_a_version_that_still_has_them(tmp_path: Path) -> None:
    engine = FlakyMetrics(max_loras=8)
    pub = Publisher([engine], name="pol", keep=1, transport="disk", root=tmp_path, max_deferred=0, drain_timeout=None, grace=0.0)
    handle = next(iter(pub._handles.values()))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert pub.publish(tiny_adapter(seed=1), version=1).settled().ok
            with engine.request("pol@v1"):
                for version in (2, 3, 4):
                    assert pub.publish(tiny_adapter(seed=version), version=version).settled().ok
                assert "pol@v1" in handle.leaks.suspects
                engine.fail = 1  # one reading fails (v5's retirement)
                assert pub.publish(tiny_adapter(seed=5), version=5).settled().ok
                assert "pol@v1" in handle.leaks.suspects  # unknown is not "no requests": still counted occupied
                for version in (6, 7):  # readings come back and still show the request
                    assert pub.publish(tiny_adapter(seed=version), version=version).settled().ok
                assert "pol@v1" in handle.leaks.suspects
            assert pub.publish(tiny_adapter(seed=8), version=8).settled().ok
            assert pub.publish(tiny_adapter(seed=9), version=9).settled().ok
            assert "pol@v1" not in handle.leaks.suspects  # its request ended: judged free
    finally:
        pub.close()


def test_a_leak_that_ended_leaves_no_trace_in_the_judge() -> None:
    # One entry per reported name was kept for ever: a long run with a leaking engine grew it by
    # one per version (found by an outside attack over 10,000 publishes).
    import asyncio

    from lorasync.publisher._leaks import SlotLeaks

    leaks = SlotLeaks(MemoryEngine(), "memory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for version in range(1, 51):
            name = f"p@v{version}"
            assert asyncio.run(leaks.check([name], listed=[name], busy=frozenset())) == {name}  # kept: reported
            assert asyncio.run(leaks.check(listed=[], busy=frozenset())) == frozenset()  # gone at the next look
            assert leaks.freed == [name]
    assert len([w for w in caught if issubclass(w.category, SlotLeakWarning)]) == 50
    assert not leaks.watching and not leaks._reported and not leaks._forced


def test_a_forced_out_version_the_engine_still_holds_is_a_leak_the_planner_believes(tmp_path: Path) -> None:
    # Forced out under a request, and the engine kept it after the request ended (a real leak):
    # the planner took "forced" for "its unloads free slots", unloaded the serving v2 early, and
    # v3's load failed with nothing served (found by an outside attack).
    engine = HiddenLeak(max_loras=2)
    pub = Publisher([engine], name="pol", keep=1, transport="ipc", root=tmp_path, max_deferred=0, drain_timeout=None, grace=0.0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert pub.publish(tiny_adapter(seed=1), version=1).settled().ok
            with engine.request("pol@v1"):
                assert pub.publish(tiny_adapter(seed=2), version=2).settled().ok
            assert engine.list_adapters() == ["pol@v2"] and set(engine._adapters) == {"pol@v1", "pol@v2"}
            report = pub.publish(tiny_adapter(seed=3), version=3)
        assert isinstance(report.results[0].error, CapacityError)
        assert "pol@v1" in str(report.results[0].error)
        assert engine.list_adapters() == ["pol@v2"]  # refused before anything moved: v2 serves on
    finally:
        pub.close()


class HiddenLeakNoRequests(HiddenLeak):
    """The hidden leak on an engine that cannot report requests (SGLang), and restarts."""

    def adapters_in_use(self):
        return None

    def restart(self) -> None:
        with self._lock:
            for name in list(self._adapters):
                MemoryEngine.unload_adapter(self, name)
            self.hidden.clear()


def test_a_restart_frees_the_leaks_of_an_engine_that_cannot_report_requests(tmp_path: Path) -> None:
    # Leaked names were kept as suspects at every check with requests unknown, so after the
    # restart the warning advises, the engine was refused for good as full (outside attack).
    engine = HiddenLeakNoRequests(max_loras=3)
    pub = Publisher([engine], name="pol", keep=1, transport="ipc", root=tmp_path, grace=0.0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for version in (1, 2, 3):
                assert pub.publish(tiny_adapter(seed=version), version=version).settled().ok
            assert set(engine._adapters) == {"pol@v1", "pol@v2", "pol@v3"}  # v1, v2 leaked
            engine.restart()
            for version in (4, 5, 6):  # it leaks again: each unload keeps one more
                report = pub.publish(tiny_adapter(seed=version), version=version).settled()
                assert report.ok, (version, report.results[0].error, sorted(engine._adapters))
            assert engine.list_adapters() == ["pol@v6"] and len(engine._adapters) == 3
            report = pub.publish(tiny_adapter(seed=7), version=7)  # full for real now: refused, v6 serves on
            assert isinstance(report.results[0].error, CapacityError)
            assert "pol@v1" not in str(report.results[0].error) and engine.list_adapters() == ["pol@v6"]
    finally:
        pub.close()


def test_requests_that_stay_unknown_stop_holding_a_phantom_slot(tmp_path: Path) -> None:
    # A version forced out under a request whose engine's request report then failed for good
    # stayed counted as occupied for the rest of the run: a round later took the serving
    # version down early for that phantom, and the new load's failure left nothing served.
    from lorasync import Fleet
    from lorasync.errors import EngineError, EngineUnavailableError
    from lorasync.publisher._leaks import UNKNOWN_CHECKS

    class MetricsDie(MemoryEngine):
        dead = False

        def adapters_in_use(self):
            if self.dead:
                raise EngineError("GET /metrics timed out")
            return super().adapters_in_use()

    engine = MetricsDie(max_loras=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Fleet([engine], root=tmp_path, transport="disk") as fleet:
            tenant = fleet.register("a", keep=1, grace=0.0, drain_timeout=0.0)
            fleet.publish({"a": tiny_adapter(seed=1)}, versions={"a": 1}).raise_for_errors()
            with engine.request("a@v1"):  # forced out under it
                for version in (2, 3):
                    fleet.publish({"a": tiny_adapter(seed=version)}, versions={"a": version}).raise_for_errors()
            handle = next(iter(tenant.publisher._handles.values()))
            assert "a@v1" in handle.leaks.suspects
            engine.dead = True  # the request ended; the report never answers again
            for version in range(4, 6 + UNKNOWN_CHECKS):
                fleet.publish({"a": tiny_adapter(seed=version)}, versions={"a": version}).raise_for_errors()
            assert "a@v1" not in handle.leaks.suspects
            last = 6 + UNKNOWN_CHECKS
            engine.fail_next("load_adapter", EngineUnavailableError("down for a moment"))
            assert fleet.publish({"a": tiny_adapter(seed=last)}, versions={"a": last})["a"].status == "failed"
            assert engine.list_adapters() == [f"a@v{last - 1}"]  # the slot was free: the previous version serves on
