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


def table(figures: dict[str, Any] | None = None) -> str:
    figures = FIGURES if figures is None else figures
    lines = ["lorasync reliability figures", "-" * 62]
    for key, label in ROWS:
        if key in figures:
            lines.append(f"{label:<50} {figures[key]!s:>10}")
    return "\n".join(lines)
