"""Real vLLM, one adapter slot: versions change while requests on older ones are still decoding.

The scenario of the crash seen on vLLM 0.32 (``--max-loras 1 --max-cpu-loras 1``, ``keep=1``): a
long request on ``policy@v1`` decodes while v2 and v3 are published. Loading v2 evicts v1 from the
worker's only slot, so every step of the v1 request reloads v1 from its path; before drain-aware
retirement, v1 was unloaded and its directory deleted, the reload raised
``LoRAAdapterNotFoundError`` and the engine core died. Shared by the pytest test and summary.py.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

# The scenario's own tiny model has a longer context than the shared one (512), so one request
# decodes for seconds: v1's requests are started, seen decoding (their first token streamed back),
# and then v2 and v3 are published while they run. An earlier design waited on /metrics for a
# batch of 480-token requests, and on a loaded CI box the batch ran out while /metrics answered.
CONTEXT = 4096
# It is wider and deeper than the shared one too, so a decoding step costs compute rather than
# vLLM's per-token work: with the shared model's 700 tokens/s across four streams, vLLM CPU 0.32's
# API server fell behind on a 2-core box and answered nothing else until the streams ended (a
# /metrics read waited 32 s, v3's load 35 s: the publishes missed the requests in three runs of
# one CI job). At this size the four stream about 190 tokens/s and the server answers in 10 ms.
MODEL = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}
# Tokens of each in-flight request: about 17 s of decoding for the four together on a 2-core box,
# of which v2's and v3's publishes took under 1 s there.
LONG = 800
V1_REQUESTS = 4  # with --max-num-seqs 4 all decode at once, each streaming its tokens
PROMPT = [5, 17, 99, 230, 41]


class _Stream:
    """One streamed greedy request: ``first`` is set once the engine sent a token (the request
    is in the engine, decoding), ``tokens`` grows as they arrive, ``error`` says how it failed and
    ``refused`` whether vLLM's API server turned it away before handing it to the engine (404:
    the name was not served when it arrived)."""

    def __init__(self, url: str, model: str, max_tokens: int, on_end: Any) -> None:
        self.url, self.model, self.max_tokens, self.on_end = url, model, max_tokens, on_end
        self.first = threading.Event()
        self.tokens: list[int] = []
        self.error: BaseException | None = None
        self.refused = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=600) as response:
                if response.status_code == 404:
                    self.refused = True
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for choice in json.loads(line[6:]).get("choices", ()):
                        self.tokens += [int(t) for t in choice.get("token_ids") or ()]
                    if self.tokens:
                        self.first.set()
        except Exception as exc:  # a lost request, recorded by the scenario
            self.error = exc
        self.first.set()
        self.on_end(self)

    @property
    def running(self) -> bool:
        return self.thread.is_alive()


def _complete(url: str, model: str, max_tokens: int) -> list[int]:
    """Greedy tokens of one request (not streamed)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    return [int(t) for t in response.json()["choices"][0]["token_ids"]]


def _reference(model: Any, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long), max_new_tokens=n, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


def _engine_uses(engine: Any, name: str) -> bool:
    """Whether the engine itself (vLLM's running/waiting gauge) names ``name`` now."""
    return name in (engine.adapters_in_use() or frozenset())


def _poll(check: Any, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return bool(check())


def run_vllm_inflight(model_dir: Path, python: Path, work: Path) -> dict[str, Any]:
    """Start a one-slot vLLM, publish v1, v2, v3 with requests in flight; count what was lost.

    Args:
        model_dir: unused beyond its presence (the scenario builds the same tiny model with a
            ``CONTEXT``-token context in ``work``).

    Returns:
        ``{"requests", "expected", "lost", "deaths", "violations", "timeline", "overlapped"}``:
        ``requests`` counts the requests that came back (each of the ``expected`` must);
        ``overlapped`` is True only when the engine still named v1 requests once v2's *and* v3's
        retirements were decided, so both retirement checks and the v1-files check met them. A
        run that overlapped less tested less: the caller runs it again.
    """
    from transformers import AutoModelForCausalLM

    from lorasync import Publisher
    from lorasync.engines import connect
    from lorasync.exporters.fsdp import export
    from lorasync.testing import make_peft_model, make_tiny_model
    from lorasync.testing.vllm_server import VLLMServer

    torch.set_num_threads(1)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "tiny-long"
    make_tiny_model(model_dir, max_position_embeddings=CONTEXT, **MODEL)
    models = {v: make_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), seed=300 + v) for v in (1, 2, 3)}
    violations: list[str] = []
    timeline: list[tuple[float, str]] = []
    t0 = time.monotonic()

    def mark(what: str) -> None:
        timeline.append((round(time.monotonic() - t0, 2), what))

    # Prefix caching off: every request here repeats PROMPT, and once the undisturbed run below
    # had filled the cache with it, vLLM CPU 0.32 served the identical streamed requests two at a
    # time (first tokens of the later two only when the first two ended), so v1's requests were
    # never all decoding while v2 and v3 were published (measured: 4 at once without the cache).
    server = VLLMServer(model_dir, python=python, served_model_name="tiny-base", max_loras=1, max_cpu_loras=1,
        extra_args=("--max-num-seqs", str(V1_REQUESTS), "--max-model-len", str(CONTEXT), "--no-enable-prefix-caching"),
        log_path=work / "vllm-inflight.log",
    )  # fmt: skip
    server.start()
    requests = lost = deaths = 0
    streams: dict[str, _Stream] = {}
    overlapped = False
    try:
        engine = connect("vllm", server.url, timeout=120)
        pub = Publisher([engine], name="policy", keep=1, root=work / "store")
        assert pub.publish(export(models[1]), version=1).ok
        undisturbed = {1: _complete(server.url, "policy@v1", LONG)}

        def start(tag: str, model: str) -> _Stream:
            streams[tag] = _Stream(server.url, model, LONG, lambda s: mark(f"{tag} finished ({len(s.tokens)} tokens)"))
            return streams[tag]

        v1 = [start(f"v1-{i}", "policy@v1") for i in range(V1_REQUESTS)]
        for stream in v1:
            stream.first.wait(timeout=300)
        if not all(s.tokens for s in v1):
            violations.append("a v1 request never streamed a token")
        mark("v1 requests decoding")
        report2 = pub.publish(export(models[2]), version=2).settled()  # its retirement decided
        # Still in the engine now, so they were while v2's retirement was decided: v1 must stay.
        # The engine's own account says so, read by the test after the decision: every v1 request
        # was admitted before v2's publish began (each had streamed a token), so the set of v1
        # requests only shrank since, and the engine naming one now named one then. A client
        # thread still reading its stream is not that evidence: on a loaded box the test's
        # threads lag the server by seconds (the publish shares their interpreter), and a
        # request the engine had finished was once counted as decoding.
        v1_after2 = _engine_uses(engine, "policy@v1")
        mark(f"v2 published (v1 in the engine after: {v1_after2}, client threads reading: {sum(s.running for s in v1)}): "
             f"retired={report2.results[0].retired} deferred={report2.results[0].deferred}")  # fmt: skip
        if not report2.ok or (v1_after2 and report2.results[0].deferred != ["policy@v1"]):
            violations.append(f"v2 publish: expected v1 deferred, got {report2}")
        v1_dir = pub.store.path_for("policy", 1)
        # A v2 request: with one slot it waits until v1's requests are done. It may reach the
        # engine after v3's retirement of v2 was decided (then vLLM refuses it: 404, never
        # admitted, not lost); once in the engine it must finish.
        start("v2-0", "policy@v2")
        report3 = pub.publish(export(models[3]), version=3).settled()
        v1_after3 = _engine_uses(engine, "policy@v1")
        mark(f"v3 published (v1 in the engine after: {v1_after3}, client threads reading: {sum(s.running for s in v1)}): "
             f"retired={report3.results[0].retired} deferred={report3.results[0].deferred}")  # fmt: skip
        if not report3.ok or (v1_after3 and "policy@v1" in report3.results[0].retired):
            violations.append(f"v3 publish retired v1 under its requests: {report3}")
        if v1_after3 and not (v1_dir / "adapter_model.safetensors").is_file():
            violations.append("v1's files were removed while its requests decoded")
        overlapped = v1_after2 and v1_after3
        for stream in streams.values():
            stream.thread.join(timeout=600)
        undisturbed[2] = _complete(server.url, "policy@v2", LONG) if "policy@v2" in engine.list_adapters() else None
        for tag, stream in streams.items():
            if stream.refused and tag == "v2-0":
                mark("v2-0 refused (404): it reached the server after v2 was retired")
                continue
            requests += 1
            want = undisturbed[int(tag[1])]
            if stream.error is not None or stream.running:
                lost += 1
                violations.append(f"request {tag} failed after {len(stream.tokens)} tokens: {stream.error!r}")
            elif want is not None and stream.tokens != want:
                lost += 1
                violations.append(f"request {tag} decoded other tokens than an undisturbed run")
        if not server.alive() or httpx.get(f"{server.url}/health", timeout=30).status_code != 200:
            deaths += 1
            violations.append("the engine died")
        short = engine.greedy("policy@v3", PROMPT, 6)[0]
        if short != _reference(models[3], 6):
            violations.append(f"v3 serves {short}, the trainer's v3 gives {_reference(models[3], 6)}")
        # Drained now: the next collection retires v1 (and v2), their files after the grace.
        _poll(lambda: not (engine.adapters_in_use() or frozenset()) & {"policy@v1", "policy@v2"}, timeout=30)
        pub.collect()
        time.sleep(pub.retention.grace + 0.1)
        pub.collect()
        mark(f"collected: engine serves {engine.list_adapters()}, on disk {pub.store.versions('policy')}")
        if engine.list_adapters() != ["policy@v3"]:
            violations.append(f"after draining, the engine serves {engine.list_adapters()}")
        if pub.store.versions("policy") != [3]:
            violations.append(f"after draining, the store holds {pub.store.versions('policy')}")
        pub.close()
    finally:
        if not server.alive():
            deaths = max(deaths, 1)
        server.stop()
    expected = V1_REQUESTS + (0 if streams.get("v2-0") and streams["v2-0"].refused else 1)
    return {"requests": requests, "expected": expected, "lost": lost, "deaths": deaths, "violations": violations, "timeline": timeline, "overlapped": overlapped}
