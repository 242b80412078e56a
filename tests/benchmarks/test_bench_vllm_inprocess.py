"""The in-process case of ``lorasync bench vllm``, for real: a ``vllm.LLM`` in the engine venv,
the quick form of its rounds (one warm-up, two timed), every first token the trainer's own.
Skips without the engine venv (fails with ``LORASYNC_REQUIRE_VLLM=1``), like the vLLM tests.
No timing assertions."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks._harness import Options
from benchmarks.vllm_inprocess import MODES, InProcessCase, enabled
from benchmarks.vllm_latency import _pick_prompt, _trainers

pytestmark = pytest.mark.vllm


def test_inprocess_rounds_serve_the_trainers_tokens_through_each_way(vllm_python: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    trainers = _trainers(tiny_model_dir, seeds=(11, 12))
    prompt, refs = _pick_prompt(trainers)
    assert refs[0] != refs[1]  # alternating versions must be told apart by their token
    case = InProcessCase(tmp_path / "inprocess", vllm_python, tiny_model_dir, trainers, prompt, refs, repeats=2, warmup=1)
    try:
        case.start()
        case.wait_ready()
        result = case.run()
    finally:
        case.close()
    assert set(result["modes"]) == set(MODES)
    for mode, samples in result["modes"].items():
        assert samples["served_new"] == [True, True], (mode, samples["token"], refs)
        assert len(samples["publish"]) == len(samples["first"]) == len(samples["total"]) == 2
        assert all(t >= p > 0 for t, p in zip(samples["total"], samples["publish"]))
    assert result["modes"]["in-process"]["transport"] == ["ipc", "ipc"]  # the default: tensors, no files
    assert result["modes"]["in-process disk"]["transport"] == ["disk", "disk"]
    assert set(result["modes"]["in-process bare add_lora"]["stages"][0]) == {"save_pretrained", "add_lora + remove_lora"}
    assert result["startup_s"] > 0


def test_inprocess_rows_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert enabled(Options())
    assert not enabled(Options(inprocess=False))
    monkeypatch.setenv("LORASYNC_BENCH_INPROCESS", "0")
    assert not enabled(Options())
