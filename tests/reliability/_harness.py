"""Scenario runners shared by the reliability tests and ``tests/reliability/summary.py``.

Each runner drives real lorasync code (Publisher, engine clients, DiskStore) against a peer that
can misbehave on purpose, and returns figures plus a list of violations (an empty list is a
pass). Tests assert on both; the summary script prints them.
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lorasync import Adapter, BaseWeights, Publisher, RetryPolicy
from lorasync.adapter._names import parse_served_name
from lorasync.errors import (
    AdapterRejectedError,
    EngineTimeoutError,
    EngineUnavailableError,
    LoraSyncError,
)
from lorasync.testing import MemoryEngine

from ._faultserver import FaultServer

ATTEMPTS = 3
RETRY = RetryPolicy(attempts=ATTEMPTS, backoff=0.005, backoff_max=0.02, jitter=0.0)
TIMEOUT = 0.4  # seconds per request in hang cases; a hung request costs ATTEMPTS * TIMEOUT
PATIENT = 5.0  # every other case: a busy CI box must never turn a slow answer into a "fault"
# q with v: SGLang packs q/k/v and refuses q_proj alone (lorasync.engines.sglang.rules).
from tests.support.adapters import MODULES, tiny_adapter  # noqa: F401 - re-exported for the scenarios


def client(protocol: str, url: str, **kwargs: Any) -> Any:
    """An engine client for ``protocol`` with the fast bounded retry policy."""
    kwargs.setdefault("timeout", TIMEOUT)
    kwargs.setdefault("retries", RETRY)
    if protocol == "vllm":
        from lorasync.engines.vllm import VLLMEngine

        return VLLMEngine(url, **kwargs)
    from lorasync.engines.sglang import SGLangEngine

    return SGLangEngine(url, **kwargs)


# -- fault matrix --------------------------------------------------------------------------------

PHASES = ("caps", "load", "models", "unload")
RETRYABLE = ("hang", "502", "503", "504", "drop", "reset", "restart")


@dataclass(frozen=True)
class FaultCase:
    """One cell: ``fault`` on the ``phase`` route of a ``protocol`` server, hitting the next
    ``times`` requests there (None: every one); ``landed``: the engine did the work first."""

    protocol: str
    phase: str
    fault: str
    times: int | None
    landed: bool = False

    @property
    def label(self) -> str:
        times = "always" if self.times is None else f"x{self.times}"
        return f"{self.protocol}:{self.phase}:{self.fault}:{times}" + (":landed" if self.landed else "")


@dataclass
class FaultOutcome:
    case: FaultCase
    status: str
    error: str | None  # error class name
    requests: int  # requests that reached the faulted route during the faulted publish
    served_after: list[int]  # versions of the name the engine serves right after it
    recovered: bool  # the next publish loaded and the engine then served exactly that version
    violations: list[str] = field(default_factory=list)


def fault_cases(protocols: tuple[str, ...] = ("vllm", "sglang")) -> Iterator[FaultCase]:
    """Every fault on every route of every protocol (landed variants where they differ)."""
    for protocol in protocols:
        yield FaultCase(protocol, "all", "refuse", None)
        for phase in PHASES:
            for fault in ("hang", "500", "502", "503", "504", "empty200", "text200", "json200err", "drop", "reset", "restart", "restart_after"):
                timings: tuple[int | None, ...] = (1, None) if fault in RETRYABLE else (1,)
                for times in timings:
                    yield FaultCase(protocol, phase, fault, times)
                if fault in ("empty200", "text200") and phase in ("load", "unload"):
                    yield FaultCase(protocol, phase, fault, 1, landed=True)
                if fault in ("hang", "drop") and phase in ("load", "unload"):
                    yield FaultCase(protocol, phase, fault, 1, landed=True)
                    if fault == "hang" and phase == "load":
                        yield FaultCase(protocol, phase, fault, None, landed=True)


def expected(case: FaultCase) -> tuple[str, str | None, int, list[int]]:
    """``(status, error class, requests on the route, versions served after)`` for v2 published
    over v1 with ``keep=1``, derived from what each fault does to one request:

    * a retryable fault hitting once is absorbed by the retry (2 requests); hitting always, it
      exhausts the ``ATTEMPTS`` budget: ``EngineUnavailableError`` (``EngineTimeoutError`` for a
      hang);
    * a 500, a JSON error or an unconfirmed odd 200 fails the request at once (1 request);
    * an odd 200 or a lost answer whose work landed is confirmed through the model list;
    * "restart" forgets every adapter (v1 included), "restart_after" does so after answering.
    """
    p, ph, f, times, landed = case.protocol, case.phase, case.fault, case.times, case.landed
    once = times == 1
    if f == "refuse":
        return "failed", "EngineUnavailableError", 0, [1]
    if ph == "caps":  # a fresh publisher probes the engine first
        if f in RETRYABLE:
            if once:
                return "loaded", None, 2, [2]
            if f == "restart":
                return "failed", "EngineUnavailableError", ATTEMPTS, []
            return "failed", "EngineTimeoutError" if f == "hang" else "EngineUnavailableError", ATTEMPTS, [1]
        if f == "restart_after":
            return "loaded", None, 1, [2]
        if f == "json200err" and p == "sglang":  # a JSON dict without enable_lora: LoRA looks off
            return "failed", "CapabilityError", 1, [1]
        return "failed", "EngineProtocolError", 1, [1]
    if ph == "load":
        if f in RETRYABLE:
            if once:
                return "loaded", None, 2, [2]
            if f == "restart":
                return "failed", "EngineUnavailableError", ATTEMPTS, []
            # every attempt lost its answer; a landed first attempt still serves (report: failed)
            served = [1, 2] if landed else [1]
            return "failed", "EngineTimeoutError" if f == "hang" else "EngineUnavailableError", ATTEMPTS, served
        if f == "restart_after":  # loaded, answered, then the engine came back empty
            return "failed", "EngineError", 1, []
        if f in ("empty200", "text200"):
            return ("loaded", None, 1, [2]) if landed else ("failed", "EngineProtocolError", 1, [1])
        if f == "json200err":
            return "failed", "EngineProtocolError" if p == "vllm" else "AdapterRejectedError", 1, [1]
        return "failed", "EngineError" if p == "vllm" else "AdapterRejectedError", 1, [1]  # 500 (SGLang's envelope)
    if ph == "models":  # read by the post-load check (file collection works from the ledger: the run's files are its own)
        if f in RETRYABLE:
            if once:
                if f == "restart":  # the engine forgot v2 right after loading it
                    return "failed", "EngineError", 2, []
                return "loaded", None, 2, [2]
            if f == "restart":
                return "failed", "EngineUnavailableError", ATTEMPTS, []
            return "failed", "EngineTimeoutError" if f == "hang" else "EngineUnavailableError", ATTEMPTS, [1, 2]
        if f == "restart_after":  # the list answered {v1, v2}, then the engine came back empty
            return "loaded", None, 1, []
        error = "EngineError" if (f == "500" and p == "vllm") else "EngineProtocolError"
        return "failed", error, 1, [1, 2]
    # unload (retiring v1 after v2 serves)
    if f in RETRYABLE:
        if once:
            if f == "restart":  # everything forgotten after the post-load check
                return "loaded", None, 2, []
            return "loaded", None, 2, [2]
        if f == "restart":
            return "failed", "EngineUnavailableError", ATTEMPTS, []
        return "failed", "EngineTimeoutError" if f == "hang" else "EngineUnavailableError", ATTEMPTS, [1, 2]
    if f == "restart_after":
        return "loaded", None, 1, []
    if f in ("empty200", "text200"):
        return ("loaded", None, 1, [2]) if landed else ("failed", "EngineProtocolError", 1, [1, 2])
    if f == "json200err":
        return "failed", "EngineProtocolError" if p == "vllm" else "AdapterRejectedError", 1, [1, 2]
    return "failed", "EngineError" if p == "vllm" else "AdapterRejectedError", 1, [1, 2]  # 500 (SGLang's envelope)


def run_fault_case(case: FaultCase, root: Path) -> FaultOutcome:
    """Publish v1, arm the fault, publish v2 (observed), disarm, publish v3 (recovery)."""
    with FaultServer(case.protocol, hang_s=TIMEOUT * 4) as server:
        # One event loop for the three publishes, as a trainer's async loop would hold.
        return asyncio.run(_fault_case(case, root, server))


async def _fault_case(case: FaultCase, root: Path, server: FaultServer) -> FaultOutcome:
    timeout = TIMEOUT if case.fault == "hang" else PATIENT
    pub = Publisher([client(case.protocol, server.url, timeout=timeout)], name="p", keep=1, transport="disk", root=root)
    first = await (await pub.apublish(tiny_adapter(1), version=1)).asettled()
    violations = [] if first.ok else [f"setup publish failed: {first}"]
    if case.phase == "caps":  # a new publisher (a restarted trainer) probes the engine again
        pub = Publisher([client(case.protocol, server.url, timeout=timeout)], name="p", keep=1, transport="disk", root=root)
    server.reset_counts()
    server.arm(case.fault, case.phase, times=case.times, landed=case.landed)
    report = await (await pub.apublish(tiny_adapter(2), version=2)).asettled()  # its retirement hits the fault too
    requests = server.requests("load" if case.phase == "all" else case.phase)
    server.disarm()
    served = server.versions("p")
    result = report.results[0]
    restart = "restart" in case.fault
    if result.status == "loaded" and 2 not in served and not restart:
        violations.append(f"reported loaded but the engine serves {served}")
    if result.status == "failed" and not restart and 1 not in served:
        violations.append(f"failed publish lost the previous version: engine serves {served}")
    if result.status == "failed" and not isinstance(result.error, LoraSyncError):
        violations.append(f"untyped error {result.error!r}")
    recovery = await (await pub.apublish(tiny_adapter(3), version=3)).asettled()
    recovered = recovery.ok and server.versions("p") == [3]
    if not recovered:
        violations.append(f"no recovery: {recovery}; engine serves {server.versions('p')}")
    violations += [f"torn: {t}" for t in server.stats["torn"]]
    for engine in pub.engines:
        await engine.aclose()
    error = type(result.error).__name__ if result.error else None
    return FaultOutcome(case, result.status, error, requests, served, recovered, violations)


def run_fault_matrix(protocols: tuple[str, ...] = ("vllm", "sglang")) -> dict[str, Any]:
    """Every case of :func:`fault_cases`, checked against :func:`expected`."""
    outcomes, violations = [], []
    with tempfile.TemporaryDirectory(prefix="lorasync-faults-") as tmp:
        for i, case in enumerate(fault_cases(protocols)):
            outcome = run_fault_case(case, Path(tmp) / f"c{i}")
            want = expected(case)
            got = (outcome.status, outcome.error, outcome.requests, outcome.served_after)
            if case.fault == "hang" and got[:2] == want[:2] and got[3] == want[3] and got[2] < want[2]:
                # A hung attempt ends at the client's own timeout, which starts before the connect:
                # on a loaded host one can end before this process's server thread read it (CI: the
                # server counted 2 of 3). Run such a case once more; a client that really sends fewer
                # requests than the policy says shows the same count again.
                outcome = run_fault_case(case, Path(tmp) / f"c{i}-again")
                got = (outcome.status, outcome.error, outcome.requests, outcome.served_after)
            if got != want:
                outcome.violations.append(f"expected {want}, got {got}")
            violations += [f"{case.label}: {v}" for v in outcome.violations]
            outcomes.append(outcome)
    return {
        "cases": len(outcomes),
        "handled": sum(not o.violations for o in outcomes),
        "retries": sum(max(0, o.requests - 1) for o in outcomes),
        # A fault that never clears fails the first call it hits: its requests are that call's.
        "max_requests": max(o.requests for o in outcomes if o.case.times is None),
        "outcomes": outcomes,
        "violations": violations,
    }


def scratch_dir() -> str:
    return tempfile.mkdtemp(prefix="lorasync-rel-", dir=os.environ.get("TMPDIR"))


# -- in-process engines: disk, ipc and merged transports with injected engine failures -----------

INPROC_FAULTS = {
    "unavailable": lambda: EngineUnavailableError("injected: connection refused", engine="memory"),
    "timeout": lambda: EngineTimeoutError("injected: no answer", engine="memory"),
    "rejected": lambda: AdapterRejectedError("injected: bad adapter", engine="memory"),
    "foreign": lambda: RuntimeError("injected: a plugin bug"),  # untranslated: must be wrapped
    "oserror": lambda: OSError(28, "No space left on device"),
}
INPROC_OPS = {
    "disk": ("load_adapter", "list_adapters", "unload_adapter"),
    "ipc": ("load_adapter_tensors", "list_adapters", "unload_adapter"),
    "merged": ("begin_weight_update", "update_weights#1", "update_weights#2"),
}


class FlakyMemoryEngine(MemoryEngine):
    """MemoryEngine whose ``n``-th next call of an operation raises (``fail_at``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._armed: dict[str, tuple[int, BaseException]] = {}

    def fail_at(self, op: str, nth: int, error: BaseException) -> None:
        with self._lock:
            self._armed[op] = (nth, error)

    def _enter(self, op: str) -> None:
        with self._lock:
            if op in self._armed:
                nth, error = self._armed[op]
                if nth <= 1:
                    del self._armed[op]
                    self.ops.append(op)
                    raise error
                self._armed[op] = (nth - 1, error)
        super()._enter(op)

    def begin_weight_update(self) -> None:
        self._enter("begin_weight_update")


def merged_base() -> BaseWeights:
    gen = torch.Generator().manual_seed(99)
    return BaseWeights.from_tensors({f"{m}.weight": torch.randn(16, 16, generator=gen) for m in MODULES})


def merged_reference(base: BaseWeights, adapter: Adapter) -> dict[str, torch.Tensor]:
    """``W0 + alpha/r · B·A`` per module in float64, written from the LoRA definition."""
    out = {}
    scale = adapter.config.lora_alpha / adapter.config.r
    for module in MODULES:
        a = adapter.tensors[f"base_model.model.{module}.lora_A.weight"].double()
        b = adapter.tensors[f"base_model.model.{module}.lora_B.weight"].double()
        out[f"{module}.weight"] = base.get(f"{module}.weight").double() + scale * (b @ a)
    return out


def _serves(engine: FlakyMemoryEngine, transport: str, base: BaseWeights, adapter: Adapter, version: int) -> bool:
    """Whether ``engine`` serves exactly ``adapter`` (as version ``version`` for LoRA transports)."""
    if transport == "merged":
        want = merged_reference(base, adapter)
        return set(engine.weights) == set(want) and all(
            torch.allclose(engine.weights[k].double(), v, atol=1e-5) for k, v in want.items()
        )
    served = engine.adapters.get(f"p@v{version}")
    return served is not None and served.content_hash == adapter.content_hash


def run_inprocess_matrix() -> dict[str, Any]:
    """Every injected failure on every operation of every in-process transport: the publish
    fails with a typed error, the engine keeps serving v1 exactly, and v3 then publishes."""
    outcomes, violations = [], []
    base = merged_base()
    ads = {v: tiny_adapter(100 + v) for v in (1, 2, 3)}
    with tempfile.TemporaryDirectory(prefix="lorasync-inproc-") as tmp:
        for transport, ops in INPROC_OPS.items():
            for op in ops:
                for fault, make in INPROC_FAULTS.items():
                    label = f"memory:{transport}:{op}:{fault}"
                    engine = FlakyMemoryEngine()
                    kwargs: dict[str, Any] = {"base": base, "bucket_bytes": 1100} if transport == "merged" else {}
                    pub = Publisher([engine], name="p", keep=1, transport=transport, root=Path(tmp) / label, **kwargs)
                    problems = []
                    if not pub.publish(ads[1], version=1).settled().ok:
                        problems.append("setup publish failed")
                    name, _, nth = op.partition("#")
                    engine.fail_at(name, int(nth or 1), make())
                    result = pub.publish(ads[2], version=2).settled().results[0]
                    if result.status != "failed" or not isinstance(result.error, LoraSyncError):
                        problems.append(f"expected a typed failure, got {result.status} {result.error!r}")
                    if not _serves(engine, transport, base, ads[1], 1):
                        problems.append("the previous version no longer serves exactly")
                    if transport != "merged" and "p@v2" in engine.adapters and name not in ("list_adapters", "unload_adapter"):
                        problems.append("the failed version serves")  # (a failure after the load may leave it loaded)
                    if not pub.publish(ads[3], version=3).settled().ok or not _serves(engine, transport, base, ads[3], 3):
                        problems.append("no recovery")
                    outcomes.append((label, result.status, type(result.error).__name__))
                    violations += [f"{label}: {p}" for p in problems]
    failing = {v.split(": ")[0] for v in violations}
    return {"cases": len(outcomes), "handled": sum(label not in failing for label, _, _ in outcomes), "outcomes": outcomes, "violations": violations}


# -- concurrency: separate publishers racing versions of one name ---------------------------------


class RecordingEngine(MemoryEngine):
    """MemoryEngine that records, per name, the max served version after every change."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.max_seen: dict[str, list[int]] = {}

    def load_adapter(self, name: str, path: Any) -> None:
        with self._lock:
            super().load_adapter(name, path)
            self._note(name)

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            super().unload_adapter(name)
            self._note(name)

    def _note(self, served: str) -> None:
        parsed = parse_served_name(served)
        if parsed is None:
            return
        versions = [p[1] for n in self.adapters if (p := parse_served_name(n)) is not None and p[0] == parsed[0]]
        history = self.max_seen.setdefault(parsed[0], [])
        top = max(versions, default=-1)
        if not history or history[-1] != top:
            history.append(top)


def _regressions(history: list[int]) -> int:
    return sum(1 for a, b in zip(history, history[1:]) if b < a)


def run_race(publishers: int = 16, versions: int = 64, *, keep: int = 2, seed: int = 0) -> dict[str, Any]:
    """``publishers`` threads, each with its own Publisher, publish versions 1..``versions`` of
    one name (version v belongs to publisher v % publishers, each in increasing order, random
    pauses) to two shared in-process engines and one vLLM-protocol server."""
    rng = random.Random(seed)
    ads = {v: tiny_adapter(1000 + v) for v in range(1, versions + 1)}
    for adapter in ads.values():
        adapter.content_hash  # noqa: B018 - hash once, outside the race
    mem = [RecordingEngine("memory://a"), RecordingEngine("memory://b")]
    reports: dict[int, Any] = {}
    errors: list[str] = []
    with FaultServer("vllm", hang_s=0.1) as server, tempfile.TemporaryDirectory(prefix="lorasync-race-") as tmp:
        barrier = threading.Barrier(publishers)
        plans = {i: [v for v in range(1, versions + 1) if v % publishers == i] for i in range(publishers)}
        pauses = {i: [rng.uniform(0, 0.01) for _ in plans[i]] for i in range(publishers)}

        def worker(i: int) -> None:
            engines = [*mem, client("vllm", server.url, timeout=10.0)]
            pub = Publisher(engines, name="race", keep=keep, transport="disk", root=tmp)
            barrier.wait()
            try:
                for version, pause in zip(plans[i], pauses[i]):
                    time.sleep(pause)
                    reports[version] = pub.publish(ads[version], version=version)
            except Exception as exc:  # a raise out of publish is itself a finding
                errors.append(f"publisher {i}: {type(exc).__name__}: {exc}")
            finally:
                pub.close()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(publishers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        histories = {e.url: e.max_seen.get("race", []) for e in mem}
        histories[server.url] = server.stats["max_seen"].get("race", [])
        finals = {e.url: max((p[1] for n in e.adapters if (p := parse_served_name(n))), default=-1) for e in mem}
        finals[server.url] = max(server.versions("race"), default=-1)
        violations = list(errors)
        for url, top in finals.items():
            if top != versions:
                violations.append(f"{url} ends on v{top}, not v{versions}")
        regressions = {url: _regressions(h) for url, h in histories.items()}
        violations += [f"{url}: max served version went down {n} times: {histories[url]}" for url, n in regressions.items() if n]
        last = reports.get(versions)
        if last is None or not last.ok:
            violations.append(f"the newest version's publish did not succeed everywhere: {last}")
        # Every adapter an engine serves must still have its complete files (vLLM re-reads them).
        missing = [f"{name} at {a.path}" for name, a in server.adapters.items() if not (Path(a.path) / "adapter_model.safetensors").is_file()]
        for engine in mem:
            missing += [f"{engine.url} {n}" for n in engine.adapters if not Path(engine.path_of(n) or "").is_dir()]
        violations += [f"served without files: {m}" for m in missing]
        violations += [f"torn: {t}" for t in server.stats["torn"]]
        statuses: dict[str, int] = {}
        for report in reports.values():
            for result in report.results:
                key = result.status if result.ok else type(result.error).__name__
                statuses[key] = statuses.get(key, 0) + 1
    return {
        "publishers": publishers,
        "versions": versions,
        "publishes": len(reports),
        "regressions": sum(regressions.values()),
        "histories": histories,
        "statuses": statuses,
        "violations": violations,
    }


# -- crash consistency: a publisher killed with SIGKILL at random moments --------------------------

STORE_FILES = {"adapter_config.json", "adapter_model.safetensors", "lorasync.json"}


RUN_FILES = {"run.json", ".owner.lock"}


def scan_store(root: Path, name: str) -> tuple[list[str], int]:
    """Check every run of ``root/name``: each ``v<N>`` holds exactly the three files (plus the
    holders record), loads, and its content matches the recorded hash. Returns ``(violations,
    hidden garbage count)``."""
    from ._faultserver import _read_version

    violations, garbage = [], 0
    base = root / name
    if not base.is_dir():
        return violations, 0
    for run in sorted(base.iterdir()):
        if not run.is_dir():
            violations.append(f"unexpected entry {run.name}")
            continue
        for entry in sorted(run.iterdir()):
            if entry.name.startswith((".tmp-", ".trash-")):
                garbage += 1
                continue
            if entry.name in RUN_FILES:
                continue
            if not (entry.name.startswith("v") and entry.name[1:].isdigit()):
                violations.append(f"unexpected entry {run.name}/{entry.name}")
                continue
            files = {p.name for p in entry.iterdir()} - {".holders.json"}
            if files != STORE_FILES:
                violations.append(f"{run.name}/{entry.name} is incomplete: {sorted(files)}")
                continue
            problem, _ = _read_version(entry)
            if problem is not None:
                violations.append(f"{run.name}/{entry.name}: {problem}")
    return violations, garbage


def _child_loop(url: str, root: str, name: str, first: int) -> None:  # pragma: no cover - child
    torch.set_num_threads(1)

    async def loop() -> None:
        pub = Publisher([client("vllm", url, timeout=5.0)], name=name, keep=2, transport="disk", root=root)
        version = first
        while True:
            await pub.apublish(tiny_adapter(version), version=version)
            version += 1

    asyncio.run(loop())


def run_crash_soak(kills: int = 40, *, seed: int = 0, max_wait: float = 0.25) -> dict[str, Any]:
    """Fork a publisher that publishes in a loop (disk transport, to a vLLM-protocol engine that
    reads every version it loads), SIGKILL it at a random moment, check the store and the
    engine, then publish once from a fresh publisher: it must sweep the dead one's temp files
    and serve a complete version. ``kills`` times."""
    import signal

    rng = random.Random(seed)
    name = "crash"
    violations: list[str] = []
    garbage_seen = swept = parent_ok = 0
    with FaultServer("vllm") as server, tempfile.TemporaryDirectory(prefix="lorasync-crash-") as tmp:
        root = Path(tmp)
        for k in range(kills):
            first = (k + 1) * 10_000
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child
                try:
                    _child_loop(server.url, tmp, name, first)
                finally:
                    os._exit(0)
            time.sleep(rng.uniform(0.0, max_wait))
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            problems, garbage = scan_store(root, name)
            garbage_seen += garbage > 0
            violations += [f"kill {k}: {p}" for p in problems]
            for served, loaded in server.adapters.items():
                if not (Path(loaded.path) / "adapter_model.safetensors").is_file():
                    violations.append(f"kill {k}: engine serves {served} whose files are gone")
            # The next publish (a restarted trainer) recovers and sweeps.
            version = first + 9_999
            report = Publisher([client("vllm", server.url, timeout=5.0)], name=name, keep=2, transport="disk", root=root).publish(
                tiny_adapter(version), version=version
            ).settled()
            parent_ok += report.ok
            if not report.ok:
                violations.append(f"kill {k}: publish after the crash failed: {report}")
            problems, garbage = scan_store(root, name)
            violations += [f"kill {k} (after the next publish): {p}" for p in problems]
            if garbage:
                violations.append(f"kill {k}: {garbage} temp/trash entries survived the next publish")
            elif garbage_seen:
                swept += 1
            if server.versions(name)[-1:] != [version]:
                violations.append(f"kill {k}: engine serves {server.versions(name)} after the next publish")
        stats = server.stats
        violations += [f"torn: {t}" for t in stats["torn"]]
    return {
        "kills": kills,
        "loads_landed": stats["loads_landed"],
        "kills_leaving_garbage": garbage_seen,
        "recovered": parent_ok,
        "torn": len(stats["torn"]),
        "violations": violations,
    }
