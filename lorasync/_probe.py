"""Probe: a trainer-side expectation checked through the engine after a publish.

The trainer greedy-decodes a few tokens from a prompt with its own model and records the chosen
tokens and their log-probabilities. After loading, the publisher asks the engine for the same
and fails that engine's result on a mismatch: a stale, mis-scaled or wrong adapter shows up here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lorasync.errors import ConfigError

__all__ = ["Probe"]


@dataclass(frozen=True)
class Probe:
    """Expected greedy continuation of ``prompt_ids``.

    Args:
        prompt_ids: prompt token ids.
        expected_ids: the trainer model's greedy tokens.
        expected_logprobs: their log-probabilities (None: compare tokens only).
        atol: allowed absolute log-prob difference (bf16 engines need ~0.05–0.1).
    """

    prompt_ids: tuple[int, ...]
    expected_ids: tuple[int, ...]
    expected_logprobs: tuple[float, ...] | None = None
    atol: float = 0.05

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "expected_ids", tuple(int(t) for t in self.expected_ids))
        if self.expected_logprobs is not None:
            object.__setattr__(self, "expected_logprobs", tuple(float(x) for x in self.expected_logprobs))
            if len(self.expected_logprobs) != len(self.expected_ids):
                raise ConfigError("expected_logprobs must have one value per expected token")
        if not self.prompt_ids or not self.expected_ids:
            raise ConfigError("a probe needs a non-empty prompt and at least one expected token")

    @classmethod
    def from_model(cls, model: Any, prompt_ids: Sequence[int], *, max_tokens: int = 8, atol: float = 0.05) -> Probe:
        """Record ``model``'s greedy continuation (a HF causal LM, e.g. the trainer's PEFT model)."""
        # On the model's device: a trainer's model usually sits on its GPU.
        device = next((p.device for p in model.parameters()), torch.device("cpu")) if hasattr(model, "parameters") else torch.device("cpu")
        ids = torch.tensor([list(prompt_ids)], device=device)
        tokens: list[int] = []
        logprobs: list[float] = []
        with torch.no_grad():
            for _ in range(max_tokens):
                logits = model(input_ids=ids).logits[0, -1].float()
                lp = torch.log_softmax(logits, dim=-1)
                tok = int(torch.argmax(lp))
                tokens.append(tok)
                logprobs.append(float(lp[tok]))
                ids = torch.cat([ids, torch.tensor([[tok]], device=device)], dim=1)
        return cls(tuple(prompt_ids), tuple(tokens), tuple(logprobs), atol)

    def mismatch(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> str | None:
        """Why the engine's answer differs from the expectation; None if it matches."""
        got = [int(t) for t in ids]
        if got != list(self.expected_ids):
            return f"greedy tokens {got} != expected {list(self.expected_ids)}"
        if self.expected_logprobs is not None and logprobs is not None:
            for i, (a, b) in enumerate(zip(logprobs, self.expected_logprobs)):
                if not math.isfinite(a) or abs(a - b) > self.atol:
                    return f"token {i} logprob {a:.5f} differs from expected {b:.5f} by more than {self.atol}"
        return None
