"""Verification power (issue 15): a stale engine still serving v(N-1) while v(N) differs by 1 %
in ``lora_B``. The default probe (atol 0.05) lets it pass; the probe must say so (power stated
from the trainer's own log-prob deltas, a warning) and ``strict`` mode must catch it while a
correct engine still passes. Engine: the real in-process PEFT engine."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lorasync import Probe
from lorasync.errors import LoraSyncWarning

PROMPTS = ([1, 17, 42, 99, 311, 5, 250], [3, 8, 120, 77, 410])
FLOOR = 1e-5


def run_probe_power(seeds: tuple[int, ...] = (3, 4, 5)) -> dict[str, Any]:
    """``tried``: (training, prompt) pairs; ``handled``: the probe stated its power correctly
    (and warned when blind), strict mode failed the stale engine and passed the fresh one.
    ``blind_default``: pairs where the default probe let the stale engine pass."""
    from lorasync.engines.peft import PeftEngine
    from lorasync.exporters.fsdp import export
    from lorasync.testing import make_peft_model, make_tiny_model

    tried = handled = blind = 0
    seps: list[float] = []
    violations: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        engine = PeftEngine(make_tiny_model(seed=0))
        for seed in seeds:
            old = make_peft_model(make_tiny_model(seed=0), seed=seed).eval()
            new = make_peft_model(make_tiny_model(seed=0), seed=seed).eval()
            with torch.no_grad():
                for name, param in new.named_parameters():
                    if ".lora_B." in name:
                        param.mul_(1.01)  # one small training step
            engine.load_adapter_tensors("stale@v2", export(old))  # v2's name, v1's weights
            engine.load_adapter_tensors("fresh@v2", export(new))
            for prompt in PROMPTS:
                tried += 1
                label = f"seed {seed}, prompt {prompt[:3]}..."
                problems: list[str] = []
                default = Probe.from_model(new, prompt, max_tokens=6)
                n = len(default.expected_ids)
                stale_ids, stale_lp = engine.greedy("stale@v2", prompt, n)
                fresh_ids, fresh_lp = engine.greedy("fresh@v2", prompt, n)
                default_catches = default.mismatch(stale_ids, stale_lp) is not None
                blind += not default_catches
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", LoraSyncWarning)
                    informed = Probe.from_model(new, prompt, max_tokens=6, previous=old)
                warned = any(issubclass(w.category, LoraSyncWarning) for w in caught)
                if informed.detects_previous != default_catches:
                    problems.append(f"power stated as detects_previous={informed.detects_previous}, the stale engine was caught: {default_catches}")
                if warned == default_catches:
                    problems.append("warned although the probe catches the stale engine" if warned else "no warning for a blind probe")
                if ("would PASS" in informed.describe()) == default_catches:
                    problems.append(f"describe() says: {informed.describe()}")
                # The in-process engine computes in float32 like the trainer: a tight floor fits.
                strict = informed.strict(floor=FLOOR)
                if strict.mismatch(stale_ids, stale_lp) is None:
                    problems.append(f"strict (atol {strict.atol:.4g}) let the stale engine pass")
                why = strict.mismatch(fresh_ids, fresh_lp)
                if why is not None:
                    problems.append(f"strict failed the correct engine: {why}")
                if default.mismatch(fresh_ids, fresh_lp) is not None:
                    problems.append("the default probe failed the correct engine")
                seps.append(informed.separation or 0.0)
                if problems:
                    violations.append(f"{label}: " + "; ".join(problems))
                else:
                    handled += 1
            engine.unload_adapter("stale@v2")
            engine.unload_adapter("fresh@v2")
    return {"tried": tried, "handled": handled, "blind_default": blind, "separations": seps, "violations": violations}
