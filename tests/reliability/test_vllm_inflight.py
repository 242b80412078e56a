"""Real vLLM with one adapter slot (``--max-loras 1 --max-cpu-loras 1``), ``keep=1``: requests on
v1 (and v2) keep decoding while v2 and v3 are published; they finish with exactly the tokens of an
undisturbed run, the engine stays healthy, v3 serves the trainer's tokens, and v1's files go only
after it drained. Before drain-aware retirement this killed vLLM's engine core."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._figures import record
from ._inflight import run_vllm_inflight

pytestmark = pytest.mark.vllm


def test_versions_change_under_decoding_requests_on_one_slot(vllm_python: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    # The v1 requests decode for seconds after they are seen decoding; a run where they ended
    # before v3's retirement was decided tested less and is run again (a run's own violations
    # still fail the test at once).
    for attempt in range(3):
        outcome = run_vllm_inflight(tiny_model_dir, vllm_python, tmp_path / f"run{attempt}")
        if outcome["violations"] or outcome["overlapped"]:
            break
    record(inflight_requests=outcome["requests"], inflight_lost=outcome["lost"], engine_deaths=outcome["deaths"])
    assert outcome["violations"] == [], "\n".join(outcome["violations"]) + f"\ntimeline: {outcome['timeline']}"
    assert outcome["overlapped"], (
        f"in 3 runs the v1 requests never decoded across both v2's and v3's retirement: the checks did not meet "
        f"decoding v1 requests (raise LONG)"
        f"\ntimeline: {outcome['timeline']}"
    )
    assert outcome["requests"] == outcome["expected"], f"{outcome['requests']} of {outcome['expected']} requests came back"
    assert outcome["lost"] == 0 and outcome["deaths"] == 0
