"""Figures the reliability tests measured, printed as one table at the end of a pytest run (see
conftest.py) and by summary.py."""

from __future__ import annotations

from typing import Any

FIGURES: dict[str, Any] = {}

ROWS = (
    ("faults", "faults x transports tried (HTTP engines)"),
    ("faults_handled", "  ... ending in the expected report entry"),
    ("fault_retries", "  retries used (counted server-side)"),
    ("fault_max_requests", "  most requests one call made (policy: 3)"),
    ("inproc", "faults x transports tried (in-process)"),
    ("inproc_handled", "  ... failed typed, previous version kept"),
    ("kills", "SIGKILLs of a publishing process"),
    ("kills_garbage", "  kills that left temp files (all swept)"),
    ("torn", "torn adapters seen by an engine or in the store"),
    ("race", "racing publishers x versions"),
    ("races", "  races run (seeds)"),
    ("regressions", "max-served-version regressions"),
    ("fuzz_fsdp", "fuzz cases run: FSDP state dicts"),
    ("fuzz_peft", "fuzz cases run: PEFT models"),
    ("fuzz_megatron", "fuzz cases run: Megatron shards"),
    ("hostile", "hostile inputs tried"),
    ("hostile_rejected", "  ... rejected with the expected typed error"),
    ("vllm_restart", "real vLLM killed before verify, recovered"),
    ("publish_cancel_points", "publishes cancelled at each await point (all released)"),
    ("disk_full", "publishes on a full 2 MiB tmpfs (typed, nothing left)"),
    ("capacity_refusals", "full engine: refused before unloading anything"),
    ("inflight_requests", "real vLLM, 1 slot: requests decoding across publishes"),
    ("inflight_lost", "  in-flight requests lost"),
    ("engine_deaths", "  engine deaths caused"),
    ("stale", "live adapters changed in place, republished"),
    ("stale_served", "  ... published and served bit for bit (no stale skip)"),
    ("foreign_names", "foreign served names in an engine (q@v007 ...)"),
    ("foreign_names_left", "  ... left alone, publishes loaded, never misread"),
    ("untyped", "formerly untyped inputs (regex, r='4', dtypes)"),
    ("untyped_typed", "  ... refused typed (or served bit for bit)"),
    ("vanish_loads", "loads of a directory rewritten under the reader"),
    ("vanish_typed", "  ... loaded or failed typed (no crash)"),
    ("peft_configs", "hostile adapter_config.json into the PEFT engine"),
    ("peft_configs_safe", "  ... served exactly or refused, base untouched"),
    ("cancel_points", "cancels injected into a merged publish (PEFT)"),
    ("cancel_released", "  ... gate freed, one whole version, next exact"),
    ("trickle_calls", "calls to a peer trickling 1 B/0.5 s (timeout 1 s)"),
    ("trickle_bounded", "  ... EngineTimeoutError within attempts x timeout"),
    ("trickle_longest_s", "  longest such call (s)"),
    ("secret_cases", "secrets: odd keys, echoing peers, URL passwords"),
    ("secret_clean", "  ... cleaned or refused, secret shown nowhere"),
    ("probe_cases", "stale engine (v(N-1), 1 % lora_B step) vs probes"),
    ("probe_blind_default", "  ... default probe blind to it (stated + warned)"),
    ("probe_strict_ok", "  ... power right, strict caught it, fresh passed"),
)


MAXIMA = {"fault_max_requests"}  # figures that keep their largest value instead of adding up


def record(**values: Any) -> None:
    """Add measured figures (integers accumulate, except ``MAXIMA``; other values replace)."""
    for key, value in values.items():
        if isinstance(value, int) and isinstance(FIGURES.get(key), int):
            FIGURES[key] = max(FIGURES[key], value) if key in MAXIMA else FIGURES[key] + value
        else:
            FIGURES[key] = value


_SENT: dict[str, Any] = {}


def take_new() -> dict[str, Any]:
    """What :func:`record` added since the last call, in ``record``'s own terms (integers as the
    amount added, ``MAXIMA`` and other values as they are now): an xdist worker sends it to the
    controller with each test's report, and the controller ``record``s it."""
    new: dict[str, Any] = {}
    for key, value in FIGURES.items():
        before = _SENT.get(key)
        if key in _SENT and value == before:
            continue
        if isinstance(value, int) and isinstance(before, int) and key not in MAXIMA:
            new[key] = value - before
        else:
            new[key] = value
    _SENT.clear()
    _SENT.update(FIGURES)
    return new


# Issue 28's regression tests, by class of finding (see _findings.py): how they ended in this run.
FINDING_RUNS: dict[str, dict[str, int]] = {}


def record_finding_test(klass: str, outcome: str) -> None:
    """Count one regression test of ``klass`` that ended ``outcome`` (passed, failed, skipped)."""
    runs = FINDING_RUNS.setdefault(klass, {"passed": 0, "failed": 0, "skipped": 0})
    runs[outcome] = runs.get(outcome, 0) + 1


def finding_rows(runs: dict[str, dict[str, int]] | None = None) -> list[str]:
    """One row per class of issue 28's findings: findings, and how their tests ended."""
    from ._findings import by_class

    runs = FINDING_RUNS if runs is None else runs
    lines = []
    for klass, findings in by_class().items():
        if klass not in runs:
            continue
        r = runs[klass]
        value = f"{len(findings)} findings; tests {r['passed']} ok, {r['failed']} failed, {r['skipped']} skipped"
        lines.append(f"{'issue 28: ' + klass:<50} {value:>10}")
    return lines


def table(figures: dict[str, Any] | None = None, runs: dict[str, dict[str, int]] | None = None) -> str:
    figures = FIGURES if figures is None else figures
    lines = ["lorasync reliability figures", "-" * 62]
    for key, label in ROWS:
        if key in figures:
            lines.append(f"{label:<50} {figures[key]!s:>10}")
    lines.extend(finding_rows(runs))
    return "\n".join(lines)
