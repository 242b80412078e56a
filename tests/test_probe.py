"""Probe inputs (issue 33 item 21): what is not a token id or a finite log-prob is refused at
construction with a ConfigError that says what to pass, before any engine is asked."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from lorasync import Probe
from lorasync.errors import ConfigError

BAD_PROBES: dict[str, tuple[dict[str, Any], str]] = {
    "float token": ({"prompt_ids": [1.7], "expected_ids": [3]}, "prompt_ids"),
    "bool token": ({"prompt_ids": [True], "expected_ids": [3]}, "prompt_ids"),
    "negative token": ({"prompt_ids": [-3], "expected_ids": [3]}, "prompt_ids"),
    "string prompt": ({"prompt_ids": "hello", "expected_ids": [3]}, "prompt_ids"),
    "int prompt": ({"prompt_ids": 5, "expected_ids": [3]}, "prompt_ids"),
    "None prompt": ({"prompt_ids": None, "expected_ids": [3]}, "prompt_ids"),
    "2-D prompt": ({"prompt_ids": torch.tensor([[1, 2]]), "expected_ids": [3]}, "prompt_ids"),
    "float expected": ({"prompt_ids": [1], "expected_ids": [2.5]}, "expected_ids"),
    "negative expected": ({"prompt_ids": [1], "expected_ids": [-1]}, "expected_ids"),
    "nan logprob": ({"prompt_ids": [1], "expected_ids": [3], "expected_logprobs": [math.nan]}, "expected_logprobs"),
    "inf logprob": ({"prompt_ids": [1], "expected_ids": [3], "expected_logprobs": [-math.inf]}, "expected_logprobs"),
    "str logprob": ({"prompt_ids": [1], "expected_ids": [3], "expected_logprobs": ["-0.1"]}, "expected_logprobs"),
    "bool logprob": ({"prompt_ids": [1], "expected_ids": [3], "expected_logprobs": [True]}, "expected_logprobs"),
    "scalar logprobs": ({"prompt_ids": [1], "expected_ids": [3], "expected_logprobs": -0.5}, "expected_logprobs"),
    "nan previous": (
        {"prompt_ids": [1], "expected_ids": [3], "expected_logprobs": [-0.1], "previous_logprobs": [math.nan]},
        "previous_logprobs",
    ),
    "empty prompt": ({"prompt_ids": [], "expected_ids": [3]}, "prompt_ids"),
}


@pytest.mark.parametrize("case", list(BAD_PROBES))
def test_a_probe_refuses_what_is_not_token_ids_or_finite_logprobs(case: str) -> None:
    kwargs, field = BAD_PROBES[case]
    with pytest.raises(ConfigError) as info:
        Probe(**kwargs)
    assert field in str(info.value)


def test_a_probe_takes_the_token_ids_a_tokenizer_gives() -> None:
    # Token ids as trainers hold them: lists, 1-D tensors (their elements are 0-d tensors), numpy.
    import numpy as np

    probe = Probe(torch.tensor([5, 6]), np.array([7, 8]), [-0.5, np.float32(-0.25)])
    assert probe.prompt_ids == (5, 6) and probe.expected_ids == (7, 8)
    assert probe.expected_logprobs == (-0.5, -0.25)
    assert all(type(t) is int for t in probe.prompt_ids + probe.expected_ids)


@pytest.fixture(scope="module")
def tiny() -> Any:
    from lorasync.testing import make_tiny_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return make_tiny_model()


@pytest.mark.parametrize("prompt", [[], "hello", 5, [1.5, 2], [10**9]])
def test_from_model_refuses_a_prompt_that_is_not_token_ids(tiny: Any, prompt: Any) -> None:
    with pytest.raises(ConfigError, match="prompt_ids"):
        Probe.from_model(tiny, prompt, max_tokens=2)


def test_from_model_records_the_models_greedy_tokens(tiny: Any) -> None:
    probe = Probe.from_model(tiny, torch.tensor([1, 17, 42]), max_tokens=2)
    assert probe.prompt_ids == (1, 17, 42) and len(probe.expected_ids) == 2
    assert all(math.isfinite(x) and x <= 0 for x in probe.expected_logprobs or ())
