"""The fleet over the in-process vLLM engine, a real ``vllm.LLM`` and ``AsyncLLM`` with
``max_loras=3`` (and a CPU LoRA cache of 3): three tenants step while rollouts generate on the
versions they lease, a fourth is refused, a retirement frees its slots, a second run starts fresh.

vLLM lives in its own venv, so the scenarios (``peer_fleet_vllm_inprocess.py``) run there, one
LLM per mode, through the in-process trust tests' runner; this side trains the tenants (PEFT,
the numerical reference) and writes every version's adapter and greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lorasync.exporters.fsdp import export
from tests.engines.test_vllm_inprocess_trust import _passed, _run_peer
from tests.reliability._trust import step

pytestmark = pytest.mark.vllm

PEER = Path(__file__).with_name("peer_fleet_vllm_inprocess.py")
PROMPT = [5, 17, 99, 230, 41]
NEW_TOKENS = 8
ROLLOUT_TOKENS = 200  # one long rollout on a@v1 outlives the next rounds (max_model_len 256)
STEPS = 5


def _greedy(model: Any, tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long), max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT) :].tolist()


@pytest.fixture(scope="module")
def data_file(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tenants a, b, c trained for STEPS steps, then b alone once more; d one step. Each version's
    adapter (saved) and PEFT's greedy tokens for it."""
    from transformers import AutoModelForCausalLM

    from lorasync.testing import make_peft_model

    root = tmp_path_factory.mktemp("fleet-inproc")
    adapters: dict[str, list[str]] = {}
    expected: dict[str, list[list[int]]] = {}
    torch.set_num_threads(1)
    for name, seed, steps in (("a", 1, STEPS), ("b", 2, STEPS + 1), ("c", 3, STEPS), ("d", 4, 1)):
        model = make_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), r=8, seed=seed)
        adapters[name], expected[name] = [], []
        for version in range(1, steps + 1):
            if version > 1:
                step(model, seed=100 * version + seed)
            adapters[name].append(str(export(model).save(root / name / f"v{version}")))
            expected[name].append(_greedy(model))
            if (name, version) == ("a", 1):
                rollout = _greedy(model, ROLLOUT_TOKENS)
    tokens = [tuple(t) for e in expected.values() for t in e]
    assert len(set(tokens)) == len(tokens), "two versions with the same tokens: a completion could not tell them apart"
    path = root / "data.json"
    path.write_text(json.dumps({
        "model_dir": str(tiny_model_dir), "adapters": adapters, "expected": expected, "prompt": PROMPT,
        "new_tokens": NEW_TOKENS, "rollout_tokens": ROLLOUT_TOKENS, "rollout_expected": rollout, "steps": STEPS,
    }))  # fmt: skip
    return path


@pytest.fixture(scope="module")
def llm_run(vllm_python: Path, data_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run_peer(vllm_python, data_file, "llm", tmp_path_factory.mktemp("fleet-llm"), peer=PEER)


@pytest.fixture(scope="module")
def async_run(vllm_python: Path, data_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run_peer(vllm_python, data_file, "async", tmp_path_factory.mktemp("fleet-async"), peer=PEER)


@pytest.mark.parametrize("mode", ["llm", "async"])
def test_three_tenants_step_while_rollouts_generate(mode: str, request: pytest.FixtureRequest) -> None:
    """Every completion equals PEFT's tokens for the version its served name says; a rollout on
    a@v1 outlives two rounds; one changed tenant is one load; a fourth is refused; retire frees."""
    _passed(request.getfixturevalue(f"{mode}_run"), "test_three_tenants_step_while_rollouts_generate")


@pytest.mark.parametrize("mode", ["llm", "async"])
def test_second_run_and_restore(mode: str, request: pytest.FixtureRequest) -> None:
    """A second fleet on the same LLM: re-registered names load their content afresh; adapters the
    engine lost are restored at unchanged versions."""
    _passed(request.getfixturevalue(f"{mode}_run"), "test_second_run_and_restore")


def test_sync_fleet_calls_on_the_asyncllm_loop_are_refused(async_run: dict[str, Any]) -> None:
    """fleet.publish()/add_engine() on the AsyncLLM's own loop raise BlockingCallError (a ConfigError)."""
    _passed(async_run, "test_sync_fleet_calls_on_the_asyncllm_loop_are_refused")
