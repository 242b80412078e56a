"""One lifecycle for the publisher's loop, locks and background work (issue 28, items 9-13, 20,
24, 28, 29): no call hangs, every misuse is a typed error that says what to do, and no
retirement is lost or reported nowhere.

Each test reproduces a bug the way a user hit it on main. Every call that could hang runs under
a bound (:func:`bounded`, ``report.settled(timeout=...)``, a watchdog on a forked child), so a
regression fails instead of hanging the suite; no test waits on wall-clock speed.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc
import json
import math
import os
import pickle
import signal
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest

import lorasync.publisher._aftercare as aftercare
from lorasync import Publisher, Retention, RetentionWarning
from lorasync.errors import (
    BlockingCallError,
    ConfigError,
    EngineTimeoutError,
    EngineUnavailableError,
    LoraSyncError,
    PublisherClosedError,
)
from lorasync.testing import MemoryEngine
from tests.support.adapters import tiny_adapter as adapter

#: How long any one call may take before the test calls it hung (a loaded 2-core box is slow;
#: a hang is for ever). Only a regression ever waits this long.
BOUND_S = 90.0


@pytest.fixture(scope="module", autouse=True)
def _warm(tmp_path_factory):
    # The first publish of a process imports PEFT (it writes the adapter config): seconds on a
    # busy box, which must not count against any bound below.
    pub = Publisher([MemoryEngine()], name="warm", root=tmp_path_factory.mktemp("warm"))
    pub.publish(adapter(0), version=0).settled()
    pub.close()


def bounded(fn: Callable[..., Any], *args: Any, what: str = "the call", **kwargs: Any) -> Any:
    """Run ``fn`` in a daemon thread and return (or raise) what it did; fail if it hangs."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    if thread.is_alive():
        pytest.fail(f"{what} hung (still running after {BOUND_S:g} s)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Gated(MemoryEngine):
    """A server whose loads wait for ``go`` (a slow load in flight); ``loading`` says one started."""

    def __init__(self, *, open_: bool = False) -> None:
        super().__init__()
        self.loading = threading.Event()
        self.go = threading.Event()
        if open_:
            self.go.set()

    def load_adapter(self, name, path):
        self.loading.set()
        if not self.go.wait(BOUND_S):
            raise EngineTimeoutError("the test never let the load go", engine=self.kind)
        super().load_adapter(name, path)


class HomeLoopEngine(MemoryEngine):
    """An engine whose calls must run on one event loop (an AsyncLLM's), as the in-process vLLM
    engine hands them over: blocking that loop blocks every call."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._home = loop

    def home_loop(self) -> asyncio.AbstractEventLoop:
        return self._home

    async def _on_home(self, fn: Callable[..., Any], *args: Any) -> Any:
        async def direct() -> Any:
            return fn(*args)

        if asyncio.get_running_loop() is self._home:
            return await direct()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(direct(), self._home))

    async def acapabilities(self):
        return await self._on_home(self.capabilities)

    async def alist_adapters(self):
        return await self._on_home(self.list_adapters)

    async def aload_adapter(self, name, path):
        return await self._on_home(self.load_adapter, name, path)

    async def aunload_adapter(self, name):
        return await self._on_home(self.unload_adapter, name)

    async def aadapters_in_use(self):
        return await self._on_home(self.adapters_in_use)


# -- item 9: sync calls from the publisher's own loop, or a loop an engine needs --------------------


def test_sync_pin_from_a_coroutine_while_apublish_runs_never_deadlocks(tmp_path):
    # main: pin() waited for the lock the running apublish holds, on the loop it blocked: for ever.
    # Pins never wait now (issue 33 item 12: they are no longer refused either, see test_trust_loops).
    engine = Gated()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path)

    async def trainer() -> Any:
        publishing = asyncio.ensure_future(pub.apublish(adapter(1), version=1))
        while not engine.loading.is_set():
            await asyncio.sleep(0.01)
        engine.go.set()
        pub.pin(1)  # the sync form works while the publish runs
        await pub.apin(1)  # and so does the async twin
        report = await publishing
        async with pub.alease(1) as model:
            assert model == "p@v1" and pub.pinned == frozenset({1})
        assert pub.pinned == frozenset({1})  # the lease's pin is undone, the pins stay
        pub.unpin(1)
        await pub.aunpin(1)
        assert pub.pinned == frozenset()
        await pub.aclose()
        return report

    report = bounded(asyncio.run, trainer(), what="pin() from the loop running apublish")
    assert report.ok and report.served_name == "p@v1"


SYNC_CALLS: dict[str, tuple[Callable[[Publisher, Any], Any], str]] = {
    "publish": (lambda pub, report: pub.publish(adapter(9), version=9), "apublish"),
    "collect": (lambda pub, report: pub.collect(), "acollect"),
    "restore_base": (lambda pub, report: pub.restore_base(), "arestore_base"),
    "close": (lambda pub, report: pub.close(), "aclose"),
    "settled": (lambda pub, report: report.settled(), "asettled"),
}


@pytest.mark.parametrize("call", sorted(SYNC_CALLS))
def test_every_sync_call_from_a_loop_that_runs_apublish_names_its_async_twin(tmp_path, call):
    # main: publish()/close() there stalled 10 s (waiting for a retirement on the blocked loop),
    # pin()/unpin()/lease() passed or deadlocked depending on timing, settled() raised a bare
    # RuntimeError.
    sync, twin = SYNC_CALLS[call]
    pub = Publisher([MemoryEngine()], name="p", keep=1, root=tmp_path)

    async def trainer() -> str:
        report = await pub.apublish(adapter(1), version=1)
        try:
            sync(pub, report)
        except BlockingCallError as exc:
            assert isinstance(exc, ConfigError) and isinstance(exc, RuntimeError)
            message = str(exc)
        else:
            message = ""
        await pub.aclose()
        return message

    message = bounded(asyncio.run, trainer(), what=f"{call}() from the loop that ran apublish")
    assert f"{twin}(" in message, message


def test_a_sync_publish_from_an_engines_home_loop_raises_instead_of_deadlocking(tmp_path):
    # main: publish() ran on the publisher's thread, whose engine calls wait for the home loop,
    # which publish() itself blocked: for ever (the AsyncLLM case, issue 28 item 36).
    async def trainer() -> tuple[str, bool]:
        engine = HomeLoopEngine(asyncio.get_running_loop())
        pub = Publisher([engine], name="p", keep=1, root=tmp_path)
        try:
            pub.publish(adapter(1), version=1)
        except BlockingCallError as exc:
            refused = str(exc)
        else:
            refused = ""
        report = await pub.apublish(adapter(1), version=1)
        await report.asettled()
        await pub.aclose()
        return refused, report.ok

    refused, ok = bounded(asyncio.run, trainer(), what="publish() from the engine's home loop")
    assert "await pub.apublish(" in refused and ok


def test_a_publisher_call_from_inside_its_own_publish_raises_instead_of_deadlocking(tmp_path):
    # An engine (or a callback it runs) that calls back into the publisher while the publish
    # waits for it: main deadlocked on the publisher's lock.
    pub: Publisher

    class CallsBack(MemoryEngine):
        def load_adapter(self, name, path):
            pub.collect()
            super().load_adapter(name, path)

    engine = CallsBack()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path)
    report = bounded(pub.publish, adapter(1), version=1, what="a re-entrant collect()")
    error = report.results[0].error
    assert not report.ok and isinstance(error, BlockingCallError), report
    assert "inside" in str(error) and engine.list_adapters() == []
    pub.close()


# -- item 10: close() racing a call --------------------------------------------------------------------


def test_close_while_another_threads_publish_waits_for_the_lock(tmp_path):
    # main: the waiting publish never returned (its coroutine was left on a stopped loop).
    engine = Gated()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path)
    outcome: dict[str, Any] = {}

    def call(key: str, fn: Callable[[], Any]) -> threading.Thread:
        def target() -> None:
            try:
                outcome[key] = fn()
            except BaseException as exc:  # noqa: BLE001
                outcome[key] = exc

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        return thread

    first = call("first", lambda: pub.publish(adapter(1), version=1))
    assert engine.loading.wait(BOUND_S)  # the first publish holds the lock, its load in flight
    waiter = call("waiter", lambda: pub.publish(adapter(2), version=2))
    time.sleep(0.1)  # most likely waiting for the lock now (either way it must end at once)
    closer = call("close", pub.close)
    try:
        waiter.join(BOUND_S)
        assert not waiter.is_alive(), "the publish waiting for the lock hung after close()"
        assert isinstance(outcome["waiter"], PublisherClosedError), outcome["waiter"]
        assert "closed" in str(outcome["waiter"])
    finally:
        engine.go.set()
    first.join(BOUND_S)
    closer.join(BOUND_S)
    assert not first.is_alive() and not closer.is_alive()
    assert outcome["first"].ok and outcome["first"].served_name == "p@v1"  # the publish in flight finished
    assert outcome["close"] is None
    assert engine.list_adapters() == ["p@v1"]


def test_many_apublish_calls_waiting_on_one_loop_never_starve_the_one_that_holds_the_lock(tmp_path):
    # main: each waiter parked an executor thread in lock.acquire(); with more waiters than the
    # default executor has threads (6 on a 2-core box), the holder's own engine calls never ran.
    engine = MemoryEngine()
    pub = Publisher([engine], name="p", keep=2, root=tmp_path)
    adapters = [adapter(v) for v in range(1, 3 * (min(32, (os.cpu_count() or 1) + 4)) + 1)]

    async def trainer() -> list[Any]:
        reports = await asyncio.gather(*(pub.apublish(a, version=v) for v, a in enumerate(adapters, start=1)))
        await pub.aclose()
        return reports

    reports = bounded(asyncio.run, trainer(), what="concurrent apublish calls on one loop")
    assert all(r.ok for r in reports) and [r.version for r in reports] == list(range(1, len(adapters) + 1))
    assert sorted(engine.list_adapters()) == [f"p@v{len(adapters) - 1}", f"p@v{len(adapters)}"]


def test_close_is_idempotent_and_every_call_after_it_is_a_typed_error(tmp_path):
    engine = MemoryEngine()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path)
    report = pub.publish(adapter(1), version=1)
    pub.close()
    pub.close()  # idempotent
    bounded(asyncio.run, pub.aclose())
    for call in (
        lambda: pub.publish(adapter(2), version=2),
        pub.collect,
        pub.restore_base,
        lambda: pub.pin(1),
        lambda: pub.lease(1).__enter__(),
        lambda: asyncio.run(pub.apublish(adapter(2), version=2)),
        lambda: asyncio.run(pub.acollect()),
    ):
        with pytest.raises(PublisherClosedError, match="new Publisher"):
            bounded(call, what="a call after close()")
    pub.unpin(1)  # letting go of a lease after close is harmless
    assert report.settled(timeout=BOUND_S).ok and engine.list_adapters() == ["p@v1"]


# -- item 11: os.fork() -------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_blocks_on_the_parents_publisher(tmp_path):
    # main: publish/collect/close in the child waited for the parent's loop thread (absent in
    # the child) or a lock another parent thread held at the fork: for ever.
    engine = Gated(open_=True)
    pub = Publisher([engine], name="p", keep=1, root=tmp_path / "parent")
    first = pub.publish(adapter(1), version=1)  # its retirement may still run at the fork
    engine.go.clear()
    engine.loading.clear()
    in_flight: dict[str, Any] = {}
    holder = threading.Thread(target=lambda: in_flight.setdefault("report", pub.publish(adapter(2), version=2)), daemon=True)
    holder.start()
    assert engine.loading.wait(BOUND_S)  # a publish holds the parent's lock while we fork
    fresh_adapter = adapter(4)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child (a data-loader worker, say)
        try:
            signal.alarm(int(BOUND_S))  # never outlive a hung test
            out: dict[str, Any] = {}
            calls = {
                "publish": lambda: pub.publish(adapter(3), version=3),
                "collect": pub.collect,
                "pin": lambda: pub.pin(1),
                "settled": lambda: first.settled(),
                "close": pub.close,
                "aclose": lambda: asyncio.run(pub.aclose()),
            }
            for key, fn in calls.items():
                try:
                    fn()
                    out[key] = "returned"
                except LoraSyncError as exc:
                    out[key] = [type(exc).__name__, str(exc)]
            child = Publisher([MemoryEngine()], name="p", keep=1, root=tmp_path / "child")
            out["fresh"] = child.publish(fresh_adapter, version=4).settled().ok
            child.close()
            os.write(write, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        deadline = time.monotonic() + BOUND_S + 5
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the parent's publisher")
        status = done[1]
        assert os.WIFEXITED(status), f"the child died of signal {os.WTERMSIG(status)} (SIGALRM: it hung)"
        with os.fdopen(read, "rb") as pipe:
            out = json.loads(pipe.read() or b"{}")
    finally:
        engine.go.set()
    for key in ("publish", "collect", "pin", "settled"):
        assert out[key][0] == "PublisherClosedError" and "fork" in out[key][1], out
    assert out["close"] == out["aclose"] == "returned"  # the child lets go of its copy quietly
    assert out["fresh"] is True  # a Publisher made in the child works
    # The parent never noticed: its publish in flight finishes, and it keeps publishing.
    holder.join(BOUND_S)
    assert in_flight["report"].ok
    assert pub.publish(adapter(3), version=3).settled(timeout=BOUND_S).ok
    assert engine.list_adapters() == ["p@v3"] and pub.store.versions("p") == [3]
    pub.close()


# -- item 12: a stuck retirement ------------------------------------------------------------------------


class StuckUnload(MemoryEngine):
    """A server whose unload of one adapter does not answer until ``release``."""

    def __init__(self, stuck: str) -> None:
        super().__init__()
        self.stuck = stuck
        self.release = threading.Event()

    def unload_adapter(self, name):
        if name == self.stuck:
            self.release.wait(2 * BOUND_S)
        super().unload_adapter(name)


def test_a_stuck_retirement_is_cancelled_for_good_and_retried_later(tmp_path, monkeypatch):
    # main: the next publish waited, cancelled it, then redid it inline, calling the stuck
    # engine again: the publish was held as long as the engine hung (13 s in the repro).
    monkeypatch.setattr(aftercare, "SETTLE_WAIT_S", 0.2)  # what a stuck retirement may cost the next publish
    engine = StuckUnload("p@v1")
    pub = Publisher([engine], name="p", keep=1, root=tmp_path, grace=0.0)
    try:
        pub.publish(adapter(1), version=1).settled(timeout=BOUND_S)
        second = pub.publish(adapter(2), version=2)  # its retirement of v1 hangs in the engine
        with pytest.warns(RetentionWarning, match="did not finish"):
            third = bounded(pub.publish, adapter(3), version=3, what="the publish after a stuck retirement")
        assert third.ok and "p@v3" in engine.list_adapters()
        # The cancelled retirement says what it left behind: v1 is still loaded, with its files.
        result = second.settled(timeout=BOUND_S).results[0]
        assert result.ok and result.deferred == ["p@v1"] and result.retired == []
        assert "cancelled" in result.reason and "p@v1" in engine.list_adapters()
        assert 1 in pub.store.versions("p")
    finally:
        engine.release.set()
    # The next retirement retries it (and v2) and reports both.
    result = third.settled(timeout=BOUND_S).results[0]
    assert sorted(result.retired) == ["p@v1", "p@v2"] and result.deferred == []
    assert engine.list_adapters() == ["p@v3"]
    pub.collect()
    assert pub.store.versions("p") == [3]
    pub.close()


# -- item 13: leaving the async context -------------------------------------------------------------------


def test_leaving_async_with_after_apublish_has_no_fixed_stall(tmp_path, monkeypatch):
    # A fixed wait for the retirement would show as a hang here.
    monkeypatch.setattr(aftercare, "SETTLE_WAIT_S", 10 * BOUND_S)
    engine = MemoryEngine()

    async def trainer() -> Any:
        async with Publisher([engine], name="p", keep=1, root=tmp_path, grace=0.0) as pub:
            await pub.apublish(adapter(1), version=1)
            report = await pub.apublish(adapter(2), version=2)
        return report

    report = bounded(asyncio.run, trainer(), what="leaving `async with Publisher`")
    assert report.settled(timeout=BOUND_S).results[0].retired == ["p@v1"]
    assert engine.list_adapters() == ["p@v2"]


def test_a_sync_with_block_in_async_code_after_apublish_says_what_to_do_at_once(tmp_path, monkeypatch):
    # main: leaving `with Publisher(...)` there cost 10 s (5 s waiting for a retirement on the
    # loop it blocked, 5 s more to cancel it), then redid the retirement.
    monkeypatch.setattr(aftercare, "SETTLE_WAIT_S", 10 * BOUND_S)
    engine = MemoryEngine()

    async def trainer() -> str:
        pub = Publisher([engine], name="p", keep=1, root=tmp_path, grace=0.0)
        try:
            with pub:
                await pub.apublish(adapter(1), version=1)
        except BlockingCallError as exc:
            message = str(exc)
        else:
            message = ""
        await pub.aclose()
        return message

    message = bounded(asyncio.run, trainer(), what="leaving `with Publisher` in async code")
    assert "await pub.aclose()" in message and "async with" in message


# -- item 20: the same engine twice -----------------------------------------------------------------------


def test_the_same_engine_twice_is_refused_at_construction(tmp_path):
    engine = MemoryEngine()
    with pytest.raises(ConfigError, match="more than once"):
        Publisher([engine, engine], name="p", root=tmp_path)
    with pytest.raises(ConfigError, match="more than once"):
        Publisher(["vllm:http://127.0.0.1:1", "vllm:http://127.0.0.1:1"], name="p", root=tmp_path)
    with pytest.raises(ConfigError, match="more than once"):  # one server, spelled twice
        Publisher(["vllm:http://localhost:8000/", "vllm:HTTP://LOCALHOST:8000"], name="p", root=tmp_path)
    # Two in-process engines are two engines, whatever they call themselves.
    pub = Publisher([MemoryEngine(), MemoryEngine()], name="p", root=tmp_path)
    assert pub.publish(adapter(1), version=1).ok
    pub.close()


@pytest.mark.parametrize(
    "spellings",
    [
        ("http://127.0.0.1:8000", "http://localhost:8000/"),
        ("http://localhost:8000", "http://[::1]:8000"),
        ("http://127.0.0.1:8000/", "http://0.0.0.0:8000"),
        ("http://127.0.0.1:80", "http://localhost"),
    ],
)
def test_one_local_server_under_two_loopback_names_is_refused(tmp_path, spellings):
    """Issue 33 item 22: one vLLM server listed as ``http://127.0.0.1:8000`` and
    ``http://localhost:8000/`` made every publish fail with AdapterAlreadyLoadedError (the
    second client loads the name the first just loaded) while the server served every version.
    Every loopback name reaches the same local server: refused at construction, as one
    spelling listed twice is."""
    from lorasync import publish_adapter
    from lorasync.engines.vllm import VLLMEngine

    first, second = spellings
    with pytest.raises(ConfigError, match="more than once"):
        Publisher([VLLMEngine(first), VLLMEngine(second)], name="p", root=tmp_path)
    with pytest.raises(ConfigError, match="more than once"):
        Publisher([f"vllm:{first}", f"sglang:{second}"], name="p", root=tmp_path)
    with pytest.raises(ConfigError, match="more than once"):
        publish_adapter(adapter(1), [f"vllm:{first}", f"vllm:{second}"], name="p", version=1, root=tmp_path)


def test_servers_on_other_ports_or_hosts_are_different_engines(tmp_path):
    engines = ["vllm:http://127.0.0.1:8000", "vllm:http://localhost:8001", "vllm:http://10.0.0.2:8000", "vllm:http://10.0.0.3:8000"]
    Publisher(engines, name="p", root=tmp_path).close()


# -- item 24: dataclasses.asdict ----------------------------------------------------------------------------


def test_asdict_works_for_every_report(tmp_path):
    # main: TypeError (the retirement's future went into the copy) for every background report.
    engine = MemoryEngine()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path)
    reports = [pub.publish(adapter(1), version=1), pub.publish(adapter(2), version=2)]
    reports.append(pub.publish(adapter(2), version=3))  # unchanged
    engine.fail_next("load_adapter", EngineUnavailableError("down for maintenance", engine="memory", url="memory://"))
    reports.append(pub.publish(adapter(4), version=4))  # failed
    statuses = [r.results[0].status for r in reports]
    assert statuses == ["loaded", "loaded", "unchanged", "failed"]
    for stage in ("running", "settled"):
        for report in reports:
            as_dict = dataclasses.asdict(report)
            assert as_dict["served_name"] == report.served_name and len(as_dict["results"]) == 1, stage
            assert as_dict["results"][0]["status"] == report.results[0].status
            json.dumps(report.to_dict())
            assert pickle.loads(pickle.dumps(report)).served_name == report.served_name
            assert copy.deepcopy(report).results[0].status == report.results[0].status
            report.settled(timeout=BOUND_S)
    assert "down for maintenance" in str(dataclasses.asdict(reports[-1])["results"][0]["error"])
    pub.close()


# -- item 28: numbers that are not numbers ---------------------------------------------------------------

BAD_NUMBERS = [
    ("grace", math.nan), ("grace", math.inf), ("grace", -1.0), ("grace", True), ("grace", "1"),
    ("drain_timeout", math.nan), ("drain_timeout", math.inf), ("drain_timeout", -5), ("drain_timeout", False),
    ("keep", True), ("keep", 0), ("keep", 2.0), ("keep", math.nan),
    ("max_deferred", True), ("max_deferred", -1), ("max_deferred", 1.5), ("max_deferred", math.inf),
    ("max_staleness", True), ("max_staleness", -1), ("max_staleness", 2.5),
    ("background", 1), ("background", "yes"),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), BAD_NUMBERS, ids=lambda v: repr(v))
def test_retention_refuses_what_is_not_a_number_of_its_kind(field, value):
    # main: NaN grace retired the old version at once, NaN drain_timeout never forced.
    with pytest.raises(ConfigError, match=field) as refused:
        Retention(**{field: value})
    assert "got" in str(refused.value)


@pytest.mark.parametrize(("field", "value"), [p for p in BAD_NUMBERS if p[0] != "background"], ids=lambda v: repr(v))
def test_publisher_refuses_the_same_numbers(tmp_path, field, value):
    with pytest.raises(ConfigError, match=field):
        Publisher([MemoryEngine()], name="p", root=tmp_path, **{field: value})


@pytest.mark.parametrize("value", [True, 0, -1, 1.5, math.nan, "64"], ids=repr)
def test_publisher_refuses_a_bucket_size_that_is_not_a_positive_int(tmp_path, value):
    with pytest.raises(ConfigError, match="bucket_bytes"):
        Publisher([MemoryEngine()], name="p", root=tmp_path, bucket_bytes=value)


def test_publisher_refuses_options_of_the_wrong_kind(tmp_path):
    with pytest.raises(ConfigError, match="retention"):
        Publisher([MemoryEngine()], name="p", root=tmp_path, retention={"keep": 1})
    with pytest.raises(ConfigError, match="in_place"):
        Publisher([MemoryEngine()], name="p", root=tmp_path, in_place="no")
    assert Retention(grace=0, drain_timeout=None, max_staleness=None).grace == 0


# -- item 29: asyncio.run per step ---------------------------------------------------------------------------


def test_asyncio_run_per_step_reports_every_retirement(tmp_path):
    # main: each step's loop ended before its retirement ran; the next publish redid it and
    # reported it nowhere (settled() said retired=[]).
    engine = MemoryEngine()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path, grace=0.0)
    reports = []
    for v in range(1, 6):
        reports.append(bounded(asyncio.run, pub.apublish(adapter(v), version=v), what=f"step {v}"))
    for report in reports:
        report.settled(timeout=BOUND_S)
    assert [r.results[0].retired for r in reports] == [[], ["p@v1"], ["p@v2"], ["p@v3"], ["p@v4"]]
    assert engine.list_adapters() == ["p@v5"] and pub.store.versions("p") == [5]
    pub.close()


def test_a_retirement_left_on_a_stopped_loop_is_redone_and_reported(tmp_path):
    # loop.run_until_complete per step, the loop then closed without cancelling what is left.
    engine = MemoryEngine()
    pub = Publisher([engine], name="p", keep=1, root=tmp_path, grace=0.0)
    reports = []
    with warnings.catch_warnings():
        # Closing a loop with a task pending is the caller's doing: asyncio says so when it goes.
        warnings.simplefilter("ignore", RuntimeWarning)
        for v in range(1, 4):
            loop = asyncio.new_event_loop()
            reports.append(loop.run_until_complete(pub.apublish(adapter(v), version=v)))
            loop.close()
    last = bounded(pub.publish, adapter(4), version=4).settled(timeout=BOUND_S)
    reports.append(last)
    for report in reports:
        report.settled(timeout=BOUND_S)
    retired = [name for r in reports for name in r.results[0].retired]
    assert sorted(retired) == ["p@v1", "p@v2", "p@v3"]
    assert engine.list_adapters() == ["p@v4"]
    pub.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        del loop
        gc.collect()
