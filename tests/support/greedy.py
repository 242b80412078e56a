"""PEFT's own greedy tokens: the numerical reference every real-engine test holds completions to."""

from __future__ import annotations

import torch


def peft_greedy(model: torch.nn.Module, prompt: list[int], n: int = 6) -> list[int]:
    """The ``n`` tokens ``model`` (a PEFT model on the CPU) generates greedily after ``prompt``."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()
