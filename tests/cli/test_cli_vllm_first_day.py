"""A trainer author's first day against a real vLLM CPU server started as getting-started says
(runtime LoRA on, no dev mode, no worker extension, one LoRA slot), every command typed as a user
types it: ``python -m lorasync ...`` in a subprocess (issue 37).

* The demo leaves the server able to serve every adapter it lists, also after another adapter
  takes the only slot and vLLM re-reads an evicted one from its path (its EngineCore died when
  the demo had deleted those files).
* A re-run that starts at v1 again, merged against this server, and an engine URL ending in /v1
  each fail with an error that says what to change, and with exit code 2 (bad input) where the
  command line is what must change.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lorasync.testing.vllm_server import VLLMServer

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
SMALL = ("--max-num-seqs", "4", "--max-model-len", "256")  # two cores: keep the extra server light


@pytest.fixture(scope="module")
def server(vllm_python: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    # As docs/getting-started.md starts it: no dev mode, no worker extension, vLLM's default of one
    # LoRA slot (so a second adapter evicts the first, which vLLM later re-reads from its path).
    with VLLMServer(
        tiny_model_dir,
        python=vllm_python,
        dev_mode=False,
        max_loras=1,
        max_cpu_loras=1,
        extra_args=SMALL,
        log_path=tmp_path_factory.mktemp("vllm-logs") / "vllm-first-day.log",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def other_adapter(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from lorasync.exporters.fsdp import export
    from lorasync.testing import make_peft_model

    out = tmp_path_factory.mktemp("other") / "adapter"
    model = make_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), r=8, seed=7)
    export(model, base_model_name_or_path=str(tiny_model_dir)).save(out)
    return out


def lorasync(*argv: str, temp: Path) -> subprocess.CompletedProcess[str]:
    """``python -m lorasync ARGV`` as a user runs it (its temp folder one of the test's own)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(temp)}
    return subprocess.run([sys.executable, "-m", "lorasync", *argv], env=env, capture_output=True, text=True, timeout=600)


def listed(url: str) -> list[str]:
    cards = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return [c["id"] for c in cards if c.get("parent")]


def complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": [11, 42, 77, 105, 300], "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def serves_everything_it_lists(url: str) -> dict[str, Any]:
    """Each listed adapter answers a completion, then the server is still healthy."""
    answers = {}
    for name in listed(url):
        try:
            answers[name] = complete(url, name).status_code
        except httpx.HTTPError as exc:  # the server died on it
            answers[name] = type(exc).__name__
    try:
        health: Any = httpx.get(f"{url}/health", timeout=30).status_code
    except httpx.HTTPError as exc:
        health = type(exc).__name__
    return {"answers": answers, "health": health}


def test_the_demo_leaves_vllm_serving_every_version_it_lists(server: VLLMServer, other_adapter: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    demo = lorasync("demo", "--base", str(tiny_model_dir), "--engine", f"vllm:{server.url}", "--steps", "2", temp=tmp_path)
    assert demo.returncode == 0, demo.stderr
    assert {"demo-policy@v1", "demo-policy@v2"} <= set(listed(server.url))

    other = lorasync("publish", str(other_adapter), "--engine", f"vllm:{server.url}", "--name", "other", "--version", "1", temp=tmp_path)
    assert other.returncode == 0, other.stdout + other.stderr
    assert complete(server.url, "other@v1").status_code == 200  # takes the only slot
    # demo-policy@v2 was evicted: vLLM re-reads it from the path it was loaded from
    assert complete(server.url, "demo-policy@v2").status_code == 200, server.log_tail()
    state = serves_everything_it_lists(server.url)
    assert state == {"answers": {name: 200 for name in state["answers"]}, "health": 200}, state
    assert {"demo-policy@v1", "demo-policy@v2", "other@v1"} <= set(state["answers"])

    # A re-run continues above what the server lists, and leaves it serving everything again.
    again = lorasync("demo", "--base", str(tiny_model_dir), "--engine", f"vllm:{server.url}", "--steps", "2", "--json", temp=tmp_path)
    assert again.returncode == 0, again.stderr
    assert [s["served_name"] for s in json.loads(again.stdout)["steps"]] == ["demo-policy@v3", "demo-policy@v4"]
    assert complete(server.url, "other@v1").status_code == 200
    state = serves_everything_it_lists(server.url)
    assert state == {"answers": {name: 200 for name in state["answers"]}, "health": 200}, state
    assert {"demo-policy@v3", "demo-policy@v4"} <= set(state["answers"])


def test_a_rerun_from_v1_exits_2_and_names_the_ways_out(server: VLLMServer, other_adapter: Path, tmp_path: Path) -> None:
    argv = ("publish", str(other_adapter), "--engine", f"vllm:{server.url}", "--name", "rerun")
    assert lorasync(*argv, "--version", "3", temp=tmp_path).returncode == 0
    stale = lorasync(*argv, "--version", "1", "--json", temp=tmp_path)
    assert stale.returncode == 2, stale.stdout + stale.stderr  # the command line must change, not the engine
    error = json.loads(stale.stdout)["results"][0]["error"]
    assert error["type"] == "StaleVersionError"
    assert "would replace v3" in error["message"]
    assert "name=" in error["message"] and "version=3 + step" in error["message"] and "run=" in error["message"]


def test_merged_against_the_getting_started_server_names_the_flags(server: VLLMServer, other_adapter: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    merged = lorasync(
        "publish", str(other_adapter), "--engine", f"vllm:{server.url}", "--name", "merged", "--version", "1",
        "--transport", "merged", "--base", str(tiny_model_dir), "--json", temp=tmp_path,
    )  # fmt: skip
    assert merged.returncode == 3, merged.stdout + merged.stderr
    error = json.loads(merged.stdout)["results"][0]["error"]
    assert error["type"] == "CapabilityError"
    assert "VLLM_SERVER_DEV_MODE=1" in error["message"]
    assert "--worker-extension-cls lorasync.engines.vllm_worker.LoraSyncWorkerExtension" in error["message"]


def test_an_engine_url_ending_in_v1_is_told_to_drop_it(server: VLLMServer, other_adapter: Path, tmp_path: Path) -> None:
    out = lorasync("publish", str(other_adapter), "--engine", f"vllm:{server.url}/v1", "--name", "v1url", "--version", "1", "--json", temp=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    error = json.loads(out.stdout)["results"][0]["error"]
    assert error["type"] == "ConfigError"
    assert "drop the /v1" in error["message"] and f"vllm:{server.url}" in error["message"]
