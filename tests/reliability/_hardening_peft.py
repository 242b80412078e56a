"""Hostile ``adapter_config.json`` files against the in-process PEFT engine (issue 15).

The engine must serve exactly the factors the file holds, or refuse the directory typed; either
way the base model's weights never change: base log-probs stay bit-identical after every
load/unload, and a served adapter's log-probs equal PEFT's own model of the same factors.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from lorasync.errors import AdapterRejectedError
from lorasync.testing import make_tiny_model, tiny_llama_adapter

PROMPT = [1, 17, 42, 99, 311, 5, 250, 7]
ALL_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]

# (label, adapter_config.json changes, "refused" or "served")
HOSTILE_CONFIGS: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("init pissa (rewrites the base)", {"init_lora_weights": "pissa"}, "refused"),
    ("init pissa_niter_4", {"init_lora_weights": "pissa_niter_4"}, "refused"),
    ("init olora", {"init_lora_weights": "olora"}, "refused"),
    ("init corda", {"init_lora_weights": "corda"}, "refused"),
    ("init loftq", {"init_lora_weights": "loftq"}, "refused"),
    ("init an unknown string", {"init_lora_weights": "zeros-please"}, "refused"),
    ("targets without weights, init false", {"target_modules": ALL_ATTENTION, "init_lora_weights": False}, "refused"),
    ("regex targets, init false", {"target_modules": ".*_proj", "init_lora_weights": False}, "refused"),
    ("layer_replication", {"layer_replication": [[0, 2], [1, 2]]}, "refused"),
    ("target_parameters", {"target_parameters": ["mlp.experts.gate_up_proj"]}, "refused"),
    ("DoRA", {"use_dora": True}, "refused"),
    ("trainable_token_indices", {"trainable_token_indices": [5, 6]}, "refused"),
    ("targets without weights, default init", {"target_modules": ALL_ATTENTION}, "served"),
    ("targets without weights, init gaussian", {"target_modules": ALL_ATTENTION, "init_lora_weights": "gaussian"}, "served"),
    ("init false, targets all present", {"init_lora_weights": False}, "served"),
    ("regex targets, default init", {"target_modules": ".*self_attn.*"}, "served"),
)


def _logprobs(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)


def run_peft_configs() -> dict[str, Any]:
    """Every hostile config loaded into one PeftEngine (after a good adapter, so rollbacks and
    multi-adapter paths are exercised too) and unloaded again."""
    from peft import PeftModel

    from lorasync.engines.peft import PeftEngine

    tried = handled = 0
    violations: list[str] = []
    adapter = tiny_llama_adapter(seed=3, r=4, alpha=16.0)
    with tempfile.TemporaryDirectory(prefix="lorasync-peftcfg-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns about the odd configs it is fed
        root = Path(tmp)
        clean = adapter.save(root / "clean")
        reference = PeftModel.from_pretrained(make_tiny_model(seed=0), str(clean)).eval()
        want = _logprobs(reference, PROMPT)
        base = make_tiny_model(seed=0)
        pristine = {k: v.clone() for k, v in base.state_dict().items()}
        engine = PeftEngine(base)
        base_lp = engine.logprobs(PROMPT)
        # First into an engine serving nothing (PEFT wraps the base model then), then next to
        # another adapter (PEFT adds one), since the two take different PEFT paths.
        for i, (label, changes, outcome) in enumerate(HOSTILE_CONFIGS * 2):
            if i == len(HOSTILE_CONFIGS):
                engine.load_adapter("good@v1", clean)
            others = ["good@v1"] if i >= len(HOSTILE_CONFIGS) else []
            label = f"{label} ({'next to another adapter' if others else 'first adapter'})"
            tried += 1
            d = adapter.save(root / f"cfg{i}")
            data = json.loads((d / "adapter_config.json").read_text())
            data.update(changes)
            (d / "adapter_config.json").write_text(json.dumps(data))
            problems: list[str] = []
            try:
                engine.load_adapter("x@v1", d)
            except AdapterRejectedError:
                if outcome != "refused":
                    problems.append("refused, but the file is plain LoRA")
            except Exception as exc:  # noqa: BLE001 - the finding
                problems.append(f"{type(exc).__name__}: {str(exc)[:120]}")
            else:
                if outcome == "refused":
                    problems.append("accepted")
                got = engine.logprobs(PROMPT, adapter="x@v1")
                diff = float((got - want).abs().max())
                if diff > 1e-5:
                    problems.append(f"serves other weights than the file's: max |dlogprob| {diff:.3g} vs PEFT")
                # PEFT names the parameters base_model.model.<module>.lora_A.<slot>.weight.
                slot = engine._slots["x@v1"]  # the engine's internal PEFT name for x@v1
                layered = {n.split(".lora_")[0].removeprefix("base_model.model.")
                           for n, _ in engine.model.named_parameters() if ".lora_" in n and f".{slot}." in n}  # fmt: skip
                extra = sorted(layered - set(adapter.modules))
                if extra:
                    problems.append(f"LoRA layers on modules without weights: {extra[:3]}")
                engine.unload_adapter("x@v1")
            if engine.list_adapters() != others:
                problems.append(f"the engine now lists {engine.list_adapters()}")
            if others:
                good = float((engine.logprobs(PROMPT, adapter="good@v1") - want).abs().max())
                if good > 1e-5:
                    problems.append(f"the other adapter changed: max |dlogprob| {good:.3g}")
            if not torch.equal(engine.logprobs(PROMPT), base_lp):
                problems.append(f"base log-probs changed by {float((engine.logprobs(PROMPT) - base_lp).abs().max()):.3g}")
            if problems:
                violations.append(f"{label}: " + "; ".join(problems))
            else:
                handled += 1
        engine.unload_adapter("good@v1")
        tried += 1
        changed = [k for k, v in engine.model.state_dict().items() if k in pristine and not torch.equal(v, pristine[k])]
        if changed or set(engine.model.state_dict()) != set(pristine) or not torch.equal(engine.logprobs(PROMPT), base_lp):
            violations.append(f"after the last unload the base differs: {changed[:3]}")
        else:
            handled += 1
    return {"tried": tried, "handled": handled, "violations": violations}
