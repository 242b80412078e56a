"""Helpers for the trust tests (issue 28: owned snapshots, hash identity, torn reads, one name per
fan-out): a trainer whose LoRA tensors a no-copy export wraps, optimizer steps on it, and what
the in-process PEFT engine really serves (its own parameters, read under its lock)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

PROMPT = [5, 17, 99, 230, 41]


def trainer(base_dir: Path, *, seed: int = 3) -> Any:
    """A PEFT model over the tiny base with random ("trained") LoRA factors."""
    from transformers import AutoModelForCausalLM

    from lorasync.testing import make_peft_model

    return make_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), seed=seed)


def lora_params(model: Any) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".lora_" in n]


def step(model: Any, *, seed: int, scale: float = 0.05) -> None:
    """An optimizer step's effect: every LoRA tensor changes in place (same storage)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_params(model):
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def optimizer_step(optimizer: torch.optim.Optimizer, model: Any, *, seed: int) -> None:
    """A real optimizer step on random gradients (fused kernels too)."""
    gen = torch.Generator().manual_seed(seed)
    for p in lora_params(model):
        p.grad = torch.randn(p.shape, generator=gen)
    optimizer.step()


def state(model: Any) -> dict[str, torch.Tensor]:
    """The trainer's LoRA tensors now, by PEFT key (a copy)."""
    return {n.replace(".default.", "."): p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


def served_lora(engine: Any, served: str) -> dict[str, torch.Tensor]:
    """The LoRA tensors the PEFT engine serves as ``served``, by PEFT key (empty: not served)."""
    with engine._lock:  # the engine's internals, read as its own methods do
        slot = engine._slots.get(served)
        if slot is None:
            return {}
        return {n.replace(f".{slot}.", "."): p.detach().clone() for n, p in engine.model.named_parameters() if f".{slot}." in n}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def content_hash(tensors: dict[str, torch.Tensor], model: Any) -> str:
    """The content hash lorasync gives these tensors under ``model``'s LoRA config."""
    from lorasync import Adapter
    from lorasync.exporters.fsdp import export

    return Adapter(tensors, export(model).config).content_hash


def greedy(model: Any, prompt: list[int], n: int = 4) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
