"""Scenario runners shared by the reliability tests and ``tests/reliability/summary.py``.

Each runner drives real lorasync code (Publisher, engine clients, DiskStore) against a peer that
can misbehave on purpose, and returns figures plus a list of violations (an empty list is a
pass). Tests assert on both; the summary script prints them.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lorasync import Adapter, AdapterConfig, Publisher, RetryPolicy
from lorasync.errors import LoraSyncError

from ._faultserver import FaultServer

ATTEMPTS = 3
RETRY = RetryPolicy(attempts=ATTEMPTS, backoff=0.005, backoff_max=0.02, jitter=0.0)
TIMEOUT = 0.4  # seconds per request; a hung request costs ATTEMPTS * TIMEOUT
MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj")


def tiny_adapter(seed: int, *, r: int = 4, width: int = 16) -> Adapter:
    """A small adapter whose content depends on ``seed`` (distinct hash per seed)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module in MODULES:
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, width, generator=gen)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(width, r, generator=gen)
    return Adapter(tensors, AdapterConfig(r=r, lora_alpha=2.0 * r))


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
    if ph == "models":  # the post-load check (and vLLM's unload lookup) read the list
        if f in RETRYABLE:
            if once:
                if f == "restart":  # the engine forgot v2 right after loading it
                    return "failed", "EngineError", 2, []
                return "loaded", None, 3 if p == "vllm" else 2, [2]
            if f == "restart":
                return "failed", "EngineUnavailableError", ATTEMPTS, []
            return "failed", "EngineTimeoutError" if f == "hang" else "EngineUnavailableError", ATTEMPTS, [1, 2]
        if f == "restart_after":  # the list answered {v1, v2}, then the engine came back empty
            return "loaded", None, 2 if p == "vllm" else 1, []
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
    pub = Publisher([client(case.protocol, server.url)], name="p", keep=1, transport="disk", root=root)
    first = await pub.apublish(tiny_adapter(1), version=1)
    violations = [] if first.ok else [f"setup publish failed: {first}"]
    if case.phase == "caps":  # a new publisher (a restarted trainer) probes the engine again
        pub = Publisher([client(case.protocol, server.url)], name="p", keep=1, transport="disk", root=root)
    server.reset_counts()
    server.arm(case.fault, case.phase, times=case.times, landed=case.landed)
    report = await pub.apublish(tiny_adapter(2), version=2)
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
    recovery = await pub.apublish(tiny_adapter(3), version=3)
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
            if got != want:
                outcome.violations.append(f"expected {want}, got {got}")
            violations += [f"{case.label}: {v}" for v in outcome.violations]
            outcomes.append(outcome)
    return {
        "cases": len(outcomes),
        "handled": sum(not o.violations for o in outcomes),
        "retries": sum(max(0, o.requests - 1) for o in outcomes),
        "max_requests": max(o.requests for o in outcomes),
        "outcomes": outcomes,
        "violations": violations,
    }


def scratch_dir() -> str:
    return tempfile.mkdtemp(prefix="lorasync-rel-", dir=os.environ.get("TMPDIR"))
