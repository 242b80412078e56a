"""A long request on v1 while v2 and v3 are published, on a GPU vLLM with one adapter slot and one
cached adapter (``--max-loras 1 --max-cpu-loras 1``, the setting where vLLM re-reads an evicted
adapter from its files) and ``keep=1``: the engine stays alive, the request finishes with exactly
the tokens v1 gives undisturbed, and v3 serves afterwards."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from _vllm_setup import TOL_FLOOR, compare, completion_body, fp32_twin, greedy, load_model, parse_completion, peft_model, prompt_ids, record, teacher_forced

from conftest import gpu_server
from lorasync import Publisher
from lorasync.engines import connect
from lorasync.exporters.fsdp import export

LONG = 768


@pytest.fixture(scope="module")
def one_slot_server(qwen3_dir, tmp_path_factory):
    log = Path(os.environ.get("OUT", str(tmp_path_factory.mktemp("vllm-logs")))) / "vllm-one-slot.log"
    # No prefix cache: the undisturbed run and the in-flight one compute the same prefill.
    with gpu_server(qwen3_dir, log, max_loras=1, max_cpu_loras=1, extra=("--no-enable-prefix-caching",)) as server:
        yield server


def stream(url: str, model: str, prompt: list[int], started: threading.Event, out: dict) -> None:
    # Two candidates per token: where two runs part, whether it was a near tie shows.
    body = {**completion_body(model, prompt, LONG), "stream": True, "prompt_logprobs": None, "logprobs": 2}
    tokens: list[int] = []
    tops: list[dict[int, float]] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
            out["status"] = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                lp = choice.get("logprobs") or {}
                tokens += [int(t.split(":", 1)[1]) for t in lp.get("tokens", [])]
                tops += [{int(k.split(":", 1)[1]): float(v) for k, v in (top or {}).items()} for top in lp.get("top_logprobs", [])]
                if tokens:
                    started.set()
    except Exception as exc:  # reported by the test
        out["error"] = repr(exc)
    finally:
        started.set()
        out["tokens"] = tokens
        out["tops"] = tops


def test_request_on_v1_finishes_exactly_while_v2_and_v3_publish(one_slot_server, qwen3_dir, tmp_path):
    engine = connect("vllm", one_slot_server.url, timeout=300)
    models = [peft_model(load_model(qwen3_dir), seed=40 + v) for v in (1, 2, 3)]
    pub = Publisher([engine], name="inflight", keep=1, root=tmp_path)
    vocab = models[0].config.vocab_size
    prompt = prompt_ids(30, 16, vocab)
    try:
        report = pub.publish(export(models[0]), version=1)
        assert report.ok, report
        undisturbed: dict = {}
        stream(one_slot_server.url, "inflight@v1", prompt, threading.Event(), undisturbed)
        assert undisturbed.get("status") == 200 and len(undisturbed["tokens"]) == LONG, undisturbed.get("error")

        started, out = threading.Event(), {}
        thread = threading.Thread(target=stream, args=(one_slot_server.url, "inflight@v1", prompt, started, out))
        thread.start()
        assert started.wait(120)
        t0 = time.perf_counter()
        for version in (2, 3):
            report = pub.publish(export(models[version - 1]), version=version)
            assert report.ok, report
        published_s = time.perf_counter() - t0
        thread.join(600)
        assert out.get("status") == 200 and "error" not in out, out.get("error")
        assert httpx.get(f"{one_slot_server.url}/health", timeout=10).status_code == 200
        assert one_slot_server.alive()
        # Exactly v1: the tokens of the undisturbed run, each v1's greedy choice under HF+PEFT
        # (teacher-forced on the served sequence, within bf16 tolerance); not v3's.
        same = out["tokens"] == undisturbed["tokens"]
        seq = prompt + out["tokens"]
        v1_32, v3_32 = fp32_twin(models[0]), fp32_twin(models[2])
        gaps = {}
        for label, ref in (("v1", v1_32), ("v3", v3_32)):
            lp = teacher_forced(ref, seq)[len(prompt) - 1 : -1]
            chosen = lp.gather(1, torch.tensor(out["tokens"], device=lp.device)[:, None])[:, 0]
            gaps[label] = float((lp.max(-1).values - chosen).max())
        del v1_32, v3_32
        parted = first_difference(undisturbed, out)
        record("inflight", long_tokens=LONG, published_while_running_s=published_s, same_tokens_as_undisturbed=same,
               worst_gap_nats=gaps, first_difference=parted)  # fmt: skip
        near = 2 * TOL_FLOOR * 4
        assert gaps["v1"] <= near, gaps  # every token v1's argmax up to a near tie
        assert gaps["v3"] > gaps["v1"] * 10, gaps  # and far from what v3 would say
        # bf16 on a GPU is not batch-invariant: the in-flight request shares its steps with the
        # publishes' work and may be recomputed, so two runs of v1 can part where v1's two best
        # tokens are a near tie (issue 34, item 5: recorded above). What a user can rely on: the
        # same tokens, or a first difference at a near tie of the undisturbed run where the
        # in-flight run took its runner-up; from there on every token is v1's (gaps above).
        if not same:
            assert parted is not None and parted["undisturbed_margin"] <= near and parted["took_runner_up"], parted
        # v3 serves now; v1 is retired once vLLM reports its request finished (keep=1; the
        # /metrics gauge that says so lags by vLLM's stats interval).
        report.settled(120)
        deadline = time.monotonic() + 90
        while True:
            served_names = [n for n in engine.list_adapters() if n.startswith("inflight")]
            if served_names == ["inflight@v3"] or time.monotonic() > deadline:
                break
            pub.collect()
            time.sleep(1.0)
        assert served_names == ["inflight@v3"], served_names
        short = prompt_ids(31, 24, vocab)
        response = httpx.post(f"{one_slot_server.url}/v1/completions", json=completion_body("inflight@v3", short, 8), timeout=300)
        answer = parse_completion(response.json()["choices"][0], short)
        verdict = compare(answer, short, models[2], fp32_twin(models[2]), fp32_twin(models[0]), greedy(models[2], short, 8))
        record("inflight-v3", **verdict.as_dict())
        assert not verdict.problems and verdict.effect > verdict.tol, verdict.problems
    finally:
        pub.close()
        engine.close()


def first_difference(a: dict, b: dict) -> dict | None:
    """Where two streamed runs part: the index, both tokens, and the undisturbed run's top two
    log-probs there (its margin between best and runner-up), or None when they never part."""
    for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])):
        if x != y:
            top = sorted(a["tops"][i].items(), key=lambda kv: -kv[1]) if i < len(a.get("tops", [])) else []
            margin = top[0][1] - top[1][1] if len(top) > 1 else float("inf")
            return {
                "index": i, "undisturbed_token": x, "inflight_token": y, "undisturbed_top2": top[:2],
                "inflight_top2": sorted(b["tops"][i].items(), key=lambda kv: -kv[1])[:2] if i < len(b.get("tops", [])) else [],
                "undisturbed_margin": margin, "took_runner_up": len(top) > 1 and top[1][0] == y,
            }  # fmt: skip
    return None
