"""Print lorasync's reliability figures: faults x transports handled, retries, torn adapters,
regressions, fuzz cases, hostile inputs. Exits 1 if any scenario found a violation.

    python -m tests.reliability.summary            # bounded (what CI's pytest run measures)
    python -m tests.reliability.summary --soak     # the long soak documented in docs/reliability.md

Run from the repository root with the library importable (``PYTHONPATH=$PWD`` in a worktree).
The real-vLLM in-flight scenario (one adapter slot, versions published under decoding requests)
runs when the engine venv exists (``LORASYNC_VLLM_PYTHON``), else it says it was skipped; the
real-vLLM restart scenario runs under pytest only (``tests/reliability/test_vllm_restart.py``).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import _fuzz as fz
from . import _hardening as hd
from ._figures import table
from ._harness import run_crash_soak, run_fault_matrix, run_inprocess_matrix, run_race
from ._hostile import run_hostile
from ._publisher_hardening import run_publisher_hardening
from ._stale import run_stale_unchanged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--soak", action="store_true", help="long soak: 240 kills, 4 x 16x400 races, 1000 fuzz cases each")
    parser.add_argument("--no-vllm", action="store_true", help="skip the real-vLLM in-flight scenario (needs the engine venv)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    soak = args.soak
    figures: dict[str, object] = {}
    violations: list[str] = []
    timings: dict[str, float] = {}

    def step(name: str, run):  # type: ignore[no-untyped-def]
        start = time.monotonic()
        result = run()
        timings[name] = time.monotonic() - start
        violations.extend(f"{name}: {v}" for v in result.get("violations", []))
        return result

    faults = step("faults", run_fault_matrix)
    figures.update(faults=faults["cases"], faults_handled=faults["handled"])
    figures.update(fault_retries=faults["retries"], fault_max_requests=faults["max_requests"])
    inproc = step("inproc", run_inprocess_matrix)
    figures.update(inproc=inproc["cases"], inproc_handled=inproc["handled"])
    kills = 240 if soak else 40
    crash = step("crash", lambda: run_crash_soak(kills=kills, seed=1 if soak else 0))
    figures.update(kills=crash["kills"], kills_garbage=crash["kills_leaving_garbage"], torn=crash["torn"])
    seeds, versions = (range(100, 104), 400) if soak else (range(2), 48)
    races = [step(f"race{seed}", lambda seed=seed: run_race(publishers=16, versions=versions, seed=seed)) for seed in seeds]
    figures.update(race=f"16 x {versions}", races=len(races), regressions=sum(r["regressions"] for r in races))
    examples = 1000 if soak else 150
    for kind, strategy, check in (("fsdp", fz.fsdp_state_dicts, fz.check_fsdp_state_dict), ("peft", fz.peft_models, fz.check_peft_model),
                                  ("megatron", fz.megatron_shards, fz.check_megatron)):  # fmt: skip
        start = time.monotonic()
        try:
            figures[f"fuzz_{kind}"] = fz.fuzz(strategy(), check, examples, derandomize=not soak)
        except Exception as exc:  # a falsified property
            figures[f"fuzz_{kind}"] = "FAILED"
            violations.append(f"fuzz {kind}: {exc}")
        timings[f"fuzz_{kind}"] = time.monotonic() - start
    hostile = step("hostile", run_hostile)
    figures.update(hostile=hostile["tried"], hostile_rejected=hostile["rejected"])
    stale = step("stale", run_stale_unchanged)
    figures.update(stale=stale["cases"], stale_served=stale["cases"] - len(stale["violations"]))
    hardening = step("publisher", run_publisher_hardening)
    figures.update(publish_cancel_points=hardening["cancel_points"], disk_full=hardening["disk_full"], capacity_refusals=hardening["capacity"])
    if hardening["skipped"]:
        print(f"disk-full scenario: skipped ({hardening['skipped']})")
    if args.no_vllm:
        print("real-vLLM in-flight scenario: skipped (--no-vllm)")
    else:
        inflight = step("inflight", _vllm_inflight)
        if inflight.get("skipped"):
            print(f"real-vLLM in-flight scenario: skipped ({inflight['skipped']})")
        else:
            figures.update(inflight_requests=inflight["requests"], inflight_lost=inflight["lost"], engine_deaths=inflight["deaths"])

    foreign = step("foreign_names", hd.run_foreign_names)
    figures.update(foreign_names=foreign["tried"], foreign_names_left=foreign["handled"])
    untyped = step("untyped", hd.run_untyped)
    figures.update(untyped=untyped["tried"], untyped_typed=untyped["handled"])
    vanish = step("vanish", lambda: hd.run_vanishing(seconds=30.0 if soak else 6.0))
    figures.update(vanish_loads=vanish["loads"], vanish_typed=vanish["handled"])
    from ._hardening_peft import run_peft_configs  # lazy: builds a model

    peft_configs = step("peft_configs", run_peft_configs)
    figures.update(peft_configs=peft_configs["tried"], peft_configs_safe=peft_configs["handled"])
    from ._hardening_cancel import run_merged_cancellation

    cancels = step("cancel", run_merged_cancellation)
    figures.update(cancel_points=cancels["tried"], cancel_released=cancels["handled"])
    from ._hardening_http import run_secrets, run_trickle

    trickle = step("trickle", run_trickle)
    figures.update(trickle_calls=trickle["tried"], trickle_bounded=trickle["handled"], trickle_longest_s=str(trickle["longest"]))
    secrets = step("secrets", run_secrets)
    figures.update(secret_cases=secrets["tried"], secret_clean=secrets["handled"])
    from ._hardening_probe import run_probe_power

    power = step("probe", run_probe_power)
    figures.update(probe_cases=power["tried"], probe_blind_default=power["blind_default"], probe_strict_ok=power["handled"])

    print(table(figures))
    print(f"{'wall time (s)':<50} {sum(timings.values()):>10.0f}")
    print(f"{'violations':<50} {len(violations):>10}")
    for line in violations[:50]:
        print("  " + line)
    return 1 if violations else 0


def _vllm_inflight() -> dict[str, object]:
    """The real-vLLM scenario of test_vllm_inflight.py, when the engine venv exists."""
    import tempfile
    from pathlib import Path

    from lorasync.testing import make_tiny_model
    from lorasync.testing.vllm_server import vllm_python

    from ._inflight import run_vllm_inflight

    python = vllm_python()
    if not python.exists():
        return {"skipped": f"no vLLM engine python at {python}; run scripts/engine-venv.sh and set LORASYNC_VLLM_PYTHON", "violations": []}
    with tempfile.TemporaryDirectory(prefix="lorasync-inflight-") as tmp:
        model = Path(tmp) / "tiny"
        make_tiny_model(model)
        for attempt in range(3):  # as the test: a run where nothing overlapped tested less
            outcome = run_vllm_inflight(model, python, Path(tmp) / f"run{attempt}")
            if outcome["violations"] or outcome["overlapped"]:
                break
        if not outcome["overlapped"]:
            outcome["violations"] = [*outcome["violations"], "in 3 runs the v1 requests never decoded across both v2's and v3's retirement"]
        if outcome["requests"] != outcome["expected"]:
            outcome["violations"] = [*outcome["violations"], f"{outcome['requests']} of {outcome['expected']} requests came back"]
        return outcome


if __name__ == "__main__":
    sys.exit(main())
