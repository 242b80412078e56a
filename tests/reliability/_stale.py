"""Stale "unchanged": an Adapter over the trainer's own parameters, updated in place by the
optimizer and published again at a higher version, must be published and served, never skipped
as "unchanged" on a hash remembered from the earlier publish.

Real peer: lorasync's in-process PEFT engine (PEFT itself applies the adapter); the served LoRA
weights are compared bit for bit with the trainer's, and greedy tokens with the trainer's own.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

PROMPT = [5, 17, 99, 230, 41]
TRANSPORTS = ("disk", "ipc")


def _greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _served_lora(engine: Any, served: str) -> dict[str, torch.Tensor]:
    with engine._lock:  # the engine's internals, read as its own methods do (retirement may run now)
        slot = engine._slots[served]
        return {n.replace(f".{slot}.", "."): p.detach().clone() for n, p in engine.model.named_parameters() if f".{slot}." in n}


def run_stale_unchanged(base_dir: Path | None = None, *, steps: int = 3) -> dict[str, Any]:
    """Publish one live Adapter ``steps`` times per transport, the trainer's weights changed in
    place between publishes. Returns ``{"cases", "violations"}``."""
    from transformers import AutoModelForCausalLM

    from lorasync import Adapter, Publisher
    from lorasync.engines.peft import PeftEngine
    from lorasync.exporters.fsdp import export
    from lorasync.testing import make_peft_model, make_tiny_model

    violations: list[str] = []
    cases = 0
    with tempfile.TemporaryDirectory(prefix="lorasync-stale-") as tmp:
        if base_dir is None:
            base_dir = Path(tmp) / "base"
            make_tiny_model(base_dir)
        for transport in TRANSPORTS:
            trainer = make_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), seed=3)
            params = {n.replace(".default.", "."): p for n, p in trainer.named_parameters() if ".lora_" in n}
            live = Adapter(params, export(trainer).config)  # the trainer's own tensors, no copy
            engine = PeftEngine(base_model_path=base_dir)
            pub = Publisher([engine], name=f"stale-{transport}", transport=transport, root=Path(tmp) / transport, keep=2)
            gen = torch.Generator().manual_seed(7)
            try:
                for version in range(1, steps + 1):
                    if version > 1:
                        with torch.no_grad():  # an optimizer step: in place, same tensors
                            for p in params.values():
                                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
                    cases += 1
                    result = pub.publish(live, version=version).results[0]
                    where = f"{transport} v{version}"
                    if result.status != "loaded":
                        violations.append(f"{where}: status {result.status!r} ({result.reason}) after the weights changed in place")
                        continue
                    served = _served_lora(engine, result.served_name)
                    stale = [k for k, t in params.items() if not torch.equal(served.get(k, torch.empty(0)), t.detach())]
                    if stale:
                        violations.append(f"{where}: {len(stale)} served LoRA tensors differ from the trainer's, e.g. {stale[0]}")
                    tokens = engine.generate(PROMPT, adapter=result.served_name, max_new_tokens=4)
                    if tokens != _greedy(trainer, PROMPT, 4):
                        violations.append(f"{where}: served tokens {tokens} are not the trainer's")
            finally:
                pub.close()
    return {"cases": cases, "violations": violations}
