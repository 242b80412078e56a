"""Trust of the in-process vLLM engine (issue 28, items 30-37) against a real ``vllm.LLM`` and ``AsyncLLM``.

Both are built with ``max_loras=2`` and vLLM's default CPU LoRA cache (``max_cpu_loras`` =
``max_loras``), so three versions in use do not fit and vLLM evicts and rebuilds adapters. The
scenarios run in the vLLM engine venv (``peer_vllm_inprocess_trust.py``), one engine per mode, in
one peer run each; every test here reports one scenario, so a scenario that kills the process
(the SIGABRT of item 35, a dead engine core) shows under its own name and the others still count.
PEFT, in this venv, gives the reference tokens; each adapter's tokens with lora_B scaled twice
(vLLM's in-place scale applied again) differ from them, so a double-scaled rebuild cannot pass.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model, make_tiny_model

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
PEER = REPO / "tests" / "engines" / "peer_vllm_inprocess_trust.py"
PROMPTS = ([5, 6, 7, 8], [100, 200, 300], [11, 12, 13, 14, 15, 16])
NEW_TOKENS = 8
ROLLOUT_PROMPT = [21, 22, 23]
ROLLOUT_TOKENS = 240  # long enough to outlive two publishes on an idle box (max_model_len 256)


def _greedy(model: Any, prompt: list[int], tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _double_scaled(model: Any) -> Any:
    """The adapter as a rebuild from already-scaled lora_B tensors serves it (scale applied twice)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.mul_(model.peft_config["default"].lora_alpha / model.peft_config["default"].r)
    return model


@pytest.fixture(scope="module")
def data_file(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("inproc-trust")
    adapters, expected, rollouts = [], [], []
    for version, (seed, std) in enumerate(((1, 0.03), (7, 0.05), (11, 0.04), (13, 0.05)), start=1):
        model = make_peft_model(make_tiny_model(), r=8, alpha=16, seed=seed, std=std)  # scale 2
        adapters.append(str(export(model).save(root / f"v{version}")))
        want = [_greedy(model, p) for p in PROMPTS]
        expected.append(want)
        rollouts.append(_greedy(model, ROLLOUT_PROMPT, ROLLOUT_TOKENS))
        if version == 1:
            rollout = rollouts[0]
        twice = [_greedy(_double_scaled(model), p) for p in PROMPTS]
        assert twice != want, f"v{version}: a double-scaled rebuild would go unnoticed"
    assert len({json.dumps(e) for e in expected}) == len(expected)
    base = make_tiny_model()
    # Another base's shapes (hidden 512, not 256): names and rank pass pre-flight, vLLM refuses
    # the tensors only when it activates them.
    alien = make_peft_model(make_tiny_model(hidden_size=512, intermediate_size=1024), r=8, seed=5)
    path = root / "data.json"
    path.write_text(
        json.dumps(
            {
                "model_dir": str(tiny_model_dir),
                "adapters": adapters,
                "expected": expected,
                "base_expected": [_greedy(base, p) for p in PROMPTS],
                "prompts": [list(p) for p in PROMPTS],
                "new_tokens": NEW_TOKENS,
                "rollout_prompt": ROLLOUT_PROMPT,
                "rollout_expected": rollout,
                "rollouts_expected": rollouts,  # every adapter's, for the random walk
                "alien": str(export(alien).save(root / "alien")),
            }
        )
    )
    return path


def _run_peer(vllm_python: Path, data_file: Path, mode: str, tmp: Path, *, peer: Path = PEER) -> dict[str, Any]:
    """Run the peer module ``peer`` in the vLLM venv (tests/fleet runs its own through this too);
    returns its exit code, output and each scenario's outcome (see :func:`_passed`)."""
    results = tmp / "results.txt"
    env = dict(os.environ)
    env.update(
        LORASYNC_INPROC_DATA=str(data_file),
        LORASYNC_INPROC_MODE=mode,
        LORASYNC_PEER_RESULTS=str(results),
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB; the default takes a large share of RAM
    )
    # --capture=sys: what the engine's processes (and Python's resource tracker) write to the
    # file descriptors reaches this side, not only the failing tests' sections.
    cmd = [
        str(vllm_python), "-m", "pytest", "-q", "--capture=sys", "-p", "no:cacheprovider", "-p", "tests.engines._peer_results",
        "-o", "python_files=peer_*.py", "--basetemp", str(tmp / "peer"), str(peer),
    ]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=1500)
    outcomes: dict[str, str] = {}
    for line in results.read_text().splitlines() if results.exists() else ():
        test, what = line.rsplit(" ", 1)
        if what == "started":
            outcomes[test] = "never finished (the process died)"
        elif what.endswith("-failed"):
            outcomes[test] = "FAILED"
        elif outcomes.get(test) == "FAILED":
            continue
        elif what == "call-passed":
            outcomes[test] = "PASSED"
        elif what.endswith("-skipped"):
            outcomes[test] = "SKIPPED"
    return {"rc": out.returncode, "text": out.stdout + out.stderr, "results": outcomes}


@pytest.fixture(scope="module")
def llm_run(vllm_python: Path, data_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run_peer(vllm_python, data_file, "llm", tmp_path_factory.mktemp("peer-llm"))


@pytest.fixture(scope="module")
def async_run(vllm_python: Path, data_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run_peer(vllm_python, data_file, "async", tmp_path_factory.mktemp("peer-async"))


def _passed(run: dict[str, Any], test: str) -> None:
    status = run["results"].get(test)
    if status == "PASSED":
        return
    text = run["text"]
    where = text.rfind(f" {test} _")  # the failure's section, when pytest got to write it
    detail = text[where : where + 5000] if where >= 0 else text[-5000:]
    pytest.fail(f"peer scenario {test}: {status or 'never started'}, rc {run['rc']}\n{detail}")


# -- vllm.LLM(max_loras=2) ---------------------------------------------------------------------------


def test_llm_evicted_ipc_versions_rebuild_with_peft_tokens(llm_run: dict[str, Any]) -> None:
    """Item 30: keep=3 on a 2-entry LRU; every version, rebuilt again and again, serves PEFT's tokens."""
    _passed(llm_run, "test_evicted_ipc_versions_rebuild_with_peft_tokens")


def test_llm_missing_staged_tensors_is_vllms_not_found(llm_run: dict[str, Any]) -> None:
    """Item 34: the worker's "staged tensors missing" path raises vLLM's own LoRAAdapterNotFoundError."""
    _passed(llm_run, "test_missing_staged_tensors_is_vllms_not_found")


def test_llm_refused_activation_leaves_no_zombie(llm_run: dict[str, Any]) -> None:
    """Item 37: an adapter vLLM refuses while activating it does not stay registered."""
    _passed(llm_run, "test_refused_activation_leaves_no_zombie")


@pytest.mark.parametrize("transport", ["ipc", "disk"])
def test_llm_retired_lora_request_fails_per_request(llm_run: dict[str, Any], transport: str) -> None:
    """Item 33: a LoRARequest kept past retirement is refused at llm.generate; the engine serves on."""
    _passed(llm_run, f"test_retired_lora_request_fails_per_request[{transport}]")


def test_llm_publish_while_another_thread_generates(llm_run: dict[str, Any]) -> None:
    """Item 35: publishing while the caller's llm.generate runs in another thread never aborts."""
    _passed(llm_run, "test_publish_while_another_thread_generates")


def test_llm_verify_while_another_thread_generates_is_refused(llm_run: dict[str, Any]) -> None:
    """Item 35: lorasync's own generation (verify=) never steps a LLM another thread is generating on."""
    _passed(llm_run, "test_verify_while_another_thread_generates_is_refused")


# -- AsyncLLM(max_loras=2) ---------------------------------------------------------------------------


def test_async_rollout_on_v1_while_v2_v3_publish_keeps_peft_tokens(async_run: dict[str, Any]) -> None:
    """Item 31: every default (keep=2, IPC); v1 deferred under a rollout, v2 evicted and rebuilt."""
    _passed(async_run, "test_rollout_on_v1_while_v2_v3_publish_keeps_peft_tokens")


def test_async_forced_retirement_keeps_the_running_requests_weights(async_run: dict[str, Any]) -> None:
    """Item 32: drain_timeout=0 unloads v1 under its rollout; vLLM rebuilds it from the kept snapshot."""
    _passed(async_run, "test_forced_retirement_keeps_the_running_requests_weights")


@pytest.mark.parametrize("transport", ["ipc", "disk"])
def test_async_retired_lora_request_fails_per_request(async_run: dict[str, Any], transport: str) -> None:
    """Item 33 on an AsyncLLM: the generate of a retired version raises lorasync's typed error."""
    _passed(async_run, f"test_retired_lora_request_fails_per_request[{transport}]")


def test_async_worker_keeps_released_tensors_for_its_running_request(async_run: dict[str, Any]) -> None:
    """Item 32 for the HTTP IPC path: the worker keeps tensors lorasync released while a request it runs names them."""
    _passed(async_run, "test_worker_keeps_released_tensors_for_its_running_request")


@pytest.mark.parametrize("mode", ["llm", "async"])
def test_random_walk_serves_exactly_what_each_report_names(mode: str, request: pytest.FixtureRequest) -> None:
    """Issue 28's state machine, the smaller version on real vLLM: a seeded walk of publishes (ipc
    and disk, repeated content), rollouts in flight, forced retirement, a CPU LoRA cache smaller
    than the window, cancelled publishes, collect, close and a resumed run. Every listed version
    serves its adapter's PEFT tokens after every step, every rollout finishes with its adapter's
    tokens, and no call outlives its deadline."""
    _passed(request.getfixturevalue(f"{mode}_run"), "test_random_walk_serves_exactly_what_each_report_names")


def test_async_sync_publish_on_the_asyncllm_loop_is_refused(async_run: dict[str, Any]) -> None:
    """Item 36: Publisher.publish() on the AsyncLLM's own loop raises ConfigError (needs core-life's
    Publisher guard, which asks Engine.home_loop(); without it this deadlocks and fails)."""
    _passed(async_run, "test_sync_publish_on_the_asyncllm_loop_is_refused")


@pytest.mark.parametrize("mode", ["llm", "async"])
def test_llm_ipc_publishes_print_no_tracker_tracebacks(mode: str, request: pytest.FixtureRequest) -> None:
    """lorasync's own noise: vLLM's workers share the trainer's resource tracker, and a worker that
    unregistered the trainer's segment made the tracker print a KeyError traceback per publish."""
    run = request.getfixturevalue(f"{mode}_run")
    assert run["results"], run["text"][-3000:]
    # The tracker's traceback ends in this line (vLLM's own shutdown may still report its ring
    # buffer as leaked: a warning of vLLM's, not this).
    noise = "cache[rtype].remove(name)"
    assert noise not in run["text"], run["text"][run["text"].find(noise) - 2000 :][:3000]
