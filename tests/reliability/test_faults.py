"""Every fault on every route of a vLLM- and an SGLang-protocol engine (disk transport), and every
injected failure of every in-process transport (disk, ipc, merged): each publish ends in the
expected report entry, retries stay within the policy (counted at the server), the engine keeps
its previous version when the publish fails, and the next publish recovers."""

from __future__ import annotations

import pytest

from ._figures import record
from ._harness import ATTEMPTS, FaultCase, expected, fault_cases, run_fault_case, run_fault_matrix, run_inprocess_matrix


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_every_fault_on_every_route(protocol):
    result = run_fault_matrix((protocol,))
    record(faults=result["cases"], faults_handled=result["handled"], fault_retries=result["retries"])
    record(fault_max_requests=result["max_requests"])
    assert result["violations"] == [], "\n".join(result["violations"])
    assert result["max_requests"] <= ATTEMPTS  # bounded: no call ever exceeds the policy


def test_matrix_covers_every_fault_and_route():
    cases = list(fault_cases())
    assert {(c.protocol, c.phase) for c in cases} >= {(p, ph) for p in ("vllm", "sglang") for ph in ("caps", "load", "models", "unload")}
    from ._faultserver import FAULTS

    assert {c.fault for c in cases} == set(FAULTS)


@pytest.mark.parametrize(
    ("case", "want"),
    [
        # The bugs this suite found, spelled out: a 200 without the engine's success text used to
        # count as a load, and an engine that restarted right after answering was reported serving.
        (FaultCase("vllm", "load", "empty200", 1), ("failed", "EngineProtocolError", 1, [1])),
        (FaultCase("vllm", "load", "json200err", 1), ("failed", "EngineProtocolError", 1, [1])),
        (FaultCase("vllm", "load", "restart_after", 1), ("failed", "EngineError", 1, [])),
        (FaultCase("sglang", "load", "drop", 1, landed=True), ("loaded", None, 2, [2])),
    ],
    ids=lambda v: v.label if isinstance(v, FaultCase) else "",
)
def test_named_regressions(case, want, tmp_path):
    outcome = run_fault_case(case, tmp_path)
    assert (outcome.status, outcome.error, outcome.requests, outcome.served_after) == want == expected(case)
    assert outcome.recovered and not outcome.violations


def test_in_process_transports_fail_typed_and_keep_the_previous_version():
    result = run_inprocess_matrix()
    record(inproc=result["cases"], inproc_handled=result["handled"])
    assert result["violations"] == [], "\n".join(result["violations"])
    assert result["cases"] == 45
