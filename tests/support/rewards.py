"""Reward functions for RL trainers in tests: module-level, so TRL's AsyncGRPO rollout worker
(a spawned process) can unpickle them."""

from __future__ import annotations

from typing import Any


def count_reward(completions: list[Any], **_: Any) -> list[float]:
    """A reward that varies between completions (their length in characters), so GRPO's
    advantages are not all zero and every step moves the adapter."""
    return [float(len(str(c))) for c in completions]
