"""Real vLLM, one adapter slot: versions change while requests on older ones are still decoding.

The scenario of the crash seen on vLLM 0.32 (``--max-loras 1 --max-cpu-loras 1``, ``keep=1``): a
long request on ``policy@v1`` decodes while v2 and v3 are published. Loading v2 evicts v1 from the
worker's only slot, so every step of the v1 request reloads v1 from its path; before drain-aware
retirement, v1 was unloaded and its directory deleted, the reload raised
``LoRAAdapterNotFoundError`` and the engine core died. Shared by the pytest test and summary.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

LONG = 480  # tokens of each in-flight request
V1_REQUESTS = 8  # with --max-num-seqs 2 they run two at a time, the rest waiting: seconds in flight
PROMPT = [5, 17, 99, 230, 41]


def _complete(url: str, model: str, max_tokens: int) -> list[int]:
    """Greedy tokens of one request, through lorasync's own vLLM client (a fresh one per call:
    requests run in threads)."""
    from lorasync.engines import connect

    engine = connect("vllm", url, timeout=600)
    try:
        return engine.greedy(model, PROMPT, max_tokens)[0]
    finally:
        engine.close()


def _reference(model: Any, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long), max_new_tokens=n, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


def _poll(check: Any, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return bool(check())


def _admitted(url: str) -> int:
    """Requests the engine core holds (running + waiting), from vLLM's ``/metrics``. A request
    the API server still tokenises or queues is in neither, nor in the LoRA gauge retirement
    reads: the scenario waits until every v1 request is in the engine before it publishes, so
    "a v1 thread still runs" means "the engine knew of a v1 request" (a CI run on a loaded box
    published while one was still outside the engine and counted its retirement a violation)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def run_vllm_inflight(model_dir: Path, python: Path, work: Path) -> dict[str, Any]:
    """Start a one-slot vLLM, publish v1, v2, v3 with requests in flight; count what was lost.

    Returns:
        ``{"requests", "expected", "lost", "deaths", "violations", "timeline", "overlapped"}``:
        ``requests`` counts the requests that came back (each of the ``expected`` must);
        ``overlapped`` is True only when v1 requests were still decoding once v2's *and* v3's
        retirements were decided, so both retirement checks and the v1-files check ran. A run
        that overlapped less tested less: the caller runs it again.
    """
    from transformers import AutoModelForCausalLM

    from lorasync import Publisher
    from lorasync.engines import connect
    from lorasync.exporters.fsdp import export
    from lorasync.testing import make_peft_model
    from lorasync.testing.vllm_server import VLLMServer

    torch.set_num_threads(1)
    work.mkdir(parents=True, exist_ok=True)
    models = {v: make_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), seed=300 + v) for v in (1, 2, 3)}
    violations: list[str] = []
    timeline: list[tuple[float, str]] = []
    t0 = time.monotonic()

    def mark(what: str) -> None:
        timeline.append((round(time.monotonic() - t0, 2), what))

    server = VLLMServer(model_dir, python=python, served_model_name="tiny-base", max_loras=1, max_cpu_loras=1,
        # Two sequences at a time: the other v1 requests wait in the scheduler (waiting requests
        # need the adapter too), so v1 stays in use across both publishes on a fast box.
        extra_args=("--max-num-seqs", "2"), log_path=work / "vllm-inflight.log",
    )
    server.start()
    requests = lost = deaths = 0
    try:
        engine = connect("vllm", server.url, timeout=120)
        pub = Publisher([engine], name="policy", keep=1, root=work / "store")
        assert pub.publish(export(models[1]), version=1).ok
        undisturbed = {1: _complete(server.url, "policy@v1", LONG)}
        outcomes: dict[str, Any] = {}

        def request(tag: str, model: str) -> None:
            try:
                outcomes[tag] = _complete(server.url, model, LONG)
            except Exception as exc:  # a lost request, recorded below
                outcomes[tag] = exc
            mark(f"{tag} finished")

        threads = [threading.Thread(target=request, args=(f"v1-{i}", "policy@v1")) for i in range(V1_REQUESTS)]
        for thread in threads:
            thread.start()
        if not _poll(lambda: "policy@v1" in (engine.adapters_in_use() or ())):
            violations.append("the engine never reported the v1 requests in flight")
        if not _poll(lambda: _admitted(server.url) + sum(tag.startswith("v1-") for tag in list(outcomes)) >= V1_REQUESTS):
            violations.append(f"the engine never held all {V1_REQUESTS} v1 requests (running + waiting)")
        mark("v1 requests decoding")
        report2 = pub.publish(export(models[2]), version=2).settled()  # its retirement decided
        # Still decoding now, so they were while v2's retirement was decided: v1 must stay. (vLLM
        # sometimes answers the v2 load only once every v1 request finished: then nothing overlapped.)
        overlapped = any(t.is_alive() for t in threads[:V1_REQUESTS])
        mark(f"v2 published: retired={report2.results[0].retired} deferred={report2.results[0].deferred}")
        if not report2.ok or (overlapped and report2.results[0].deferred != ["policy@v1"]):
            violations.append(f"v2 publish: expected v1 deferred, got {report2}")
        v1_dir = pub.store.path_for("policy", 1)
        late = threading.Thread(target=request, args=("v2-0", "policy@v2"))
        late.start()
        threads.append(late)
        # (With one slot the v2 request waits until the v1 requests are done.)
        v1_running = any(t.is_alive() for t in threads[:V1_REQUESTS])
        report3 = pub.publish(export(models[3]), version=3).settled()
        # Still decoding once v3's retirement was decided, so they were when it was: v1 must stay.
        # (Requests that finish during the publish, which a slow load can take seconds for, leave
        # v1 free to go by the time its retirement is decided: a CI run saw exactly that.)
        v1_after = any(t.is_alive() for t in threads[:V1_REQUESTS])
        mark(f"v3 published (v1 requests running: {v1_running} before, {v1_after} after): retired={report3.results[0].retired} deferred={report3.results[0].deferred}")
        if not report3.ok or (v1_after and "policy@v1" in report3.results[0].retired):
            violations.append(f"v3 publish retired v1 under its requests: {report3}")
        if v1_after and not (v1_dir / "adapter_model.safetensors").is_file():
            violations.append("v1's files were removed while its requests decoded")
        # Both decisions met decoding v1 requests, or the v3 checks above could not run: the
        # caller runs the scenario again instead of accepting a run that tested less.
        overlapped = overlapped and v1_running and v1_after
        for thread in threads:
            thread.join(timeout=600)
        undisturbed[2] = _complete(server.url, "policy@v2", LONG) if "policy@v2" in engine.list_adapters() else None
        for tag, got in outcomes.items():
            requests += 1
            want = undisturbed[int(tag[1])]
            if isinstance(got, Exception):
                lost += 1
                violations.append(f"request {tag} failed: {got!r}")
            elif want is not None and got != want:
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
    expected = V1_REQUESTS + 1  # the v1 requests and the one on v2
    return {"requests": requests, "expected": expected, "lost": lost, "deaths": deaths, "violations": violations, "timeline": timeline, "overlapped": overlapped}
