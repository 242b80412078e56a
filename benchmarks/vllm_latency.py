"""Real vLLM: time from the publish call to the first completion served by the new weights, and
lorasync's client-side overhead per HTTP endpoint.

First, the benchmark of record (:mod:`benchmarks.vllm_peer`): lorasync's documented loop against
what TRL / ART / SkyRL do (PEFT ``save_pretrained`` + load + unload) and the bare unload-then-load,
on a 10 MB adapter model of its own server. Then the tiny-model modes below.

A vLLM CPU server (the engine venv, ``LORASYNC_VLLM_PYTHON``) serves lorasync's tiny Llama with
LoRA on and lorasync's worker extension. Modes: adapter over ``disk`` and ``ipc`` (versioned names,
keep=2), the ``merged`` fold, and the naive ``unload-then-load`` of one fixed name (save, unload,
load — no lorasync Publisher). Every first completion is checked against the trainer's own greedy
token, so "served by the new weights" is verified, not assumed. Client overhead: the same requests
through a bare ``httpx.Client`` and through ``VLLMEngine``, interleaved; goal ≤ 10 ms per endpoint.

Beside the HTTP modes, in the same table, JSON and plot: the in-process engine
(:mod:`benchmarks.vllm_inprocess`, a ``vllm.LLM`` in the engine venv; off with
``LORASYNC_BENCH_INPROCESS=0``).

Skipped, with a message saying what to run, when the vLLM engine venv is missing or half-built
(no ready marker; see ``lorasync.testing.venvs``). Run: ``lorasync bench vllm``.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._harness import Case, Goal, Options, Report, Table, fmt_bytes, fmt_ms, progress, say, timeit_many
from benchmarks.vllm_inprocess import InProcessCase, enabled
from benchmarks.vllm_peer import plot as plot_peer
from benchmarks.vllm_peer import run_peer

__all__ = ["run"]

NAME = "vllm"
PROMPTS = ([5, 17, 99, 230, 41], [300, 12, 7], [64, 65, 66, 67, 68, 69], [11, 22, 33], [400, 401, 402, 403])
SERVED_BASE = "tiny-base"


def run(opts: Options) -> Report:
    from lorasync.testing.venvs import engine_venv

    title = "Real vLLM: publish → first completion served by the new weights; client overhead per endpoint"
    venv = engine_venv("vllm")  # missing or half-built (no ready marker): skipped, saying what to run
    if not venv.ready:
        return Report(NAME, title, skipped=venv.problem)
    python = venv.python
    repeats, warmup = opts.reps(10, 3), opts.warm(2, 1)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny reference model is far faster on one thread of a busy box
    try:
        with tempfile.TemporaryDirectory(prefix="lorasync-bench-vllm-") as tmp:
            return _run(opts, Path(tmp), python, repeats, warmup, title)
    finally:
        torch.set_num_threads(before)


def _run(opts: Options, tmp: Path, python: Path, repeats: int, warmup: int, title: str) -> Report:
    from lorasync.testing import make_tiny_model

    show = opts.progress
    base_dir = tmp / "base"
    say(f"vLLM engine venv {python}; training two tiny adapters", show=show)
    make_tiny_model(base_dir)
    trainers = _trainers(base_dir, seeds=(11, 12))
    prompt, refs = _pick_prompt(trainers)
    adapters = [t["adapter"] for t in trainers]
    report = Report(NAME, title)
    inproc = InProcessCase(tmp / "inprocess", python, base_dir, trainers, prompt, refs, repeats, warmup) if enabled(opts) else None
    try:
        if inproc is not None:
            say(f"starting an in-process vllm.LLM in the engine venv (log {inproc.log_path}; --no-inprocess skips it)", show=show)
            inproc.start()  # its LLM starts while the HTTP server does; its rounds run after
        data, overhead, startup = _http(engine_args=(base_dir, python, tmp), adapters=adapters, refs=refs, prompt=prompt, repeats=repeats, warmup=warmup, show=show, inproc=inproc)
        if inproc is not None:
            extra = inproc.run()
            inproc.close()
            data.update(extra["modes"])
            report.notes.append(
                f"In-process rows: a vllm.LLM in the engine venv's own process (connect('vllm-inprocess', llm=llm); same LoRA limits, fp32, enforce_eager), "
                f"its rounds after the HTTP server stopped; 'in-process' is the default transport ({', '.join(sorted(set(data['in-process']['transport'])))}), "
                f"'bare add_lora' is peft save_pretrained + llm.llm_engine.add_lora(LoRARequest) + remove_lora of step-2 (no lorasync). "
                f"LLM start-up {extra['startup_s']:.0f} s (overlapping the HTTP server's; {inproc.waited_s:.0f} s waited for it), rounds {extra['rounds_s']:.1f} s."
            )
    finally:
        if inproc is not None:
            inproc.close()
    modes = tuple(data)
    rows = []
    for mode in modes:
        samples = data[mode]
        total, pub, first = (statistics.median(samples[k]) for k in ("total", "publish", "first"))
        ok = sum(samples["served_new"])
        rows.append([mode, fmt_ms(pub), fmt_ms(first), f"**{fmt_ms(total)}**", f"{ok}/{len(samples['served_new'])}"])
    staged = [m for m in modes if m != "unload-then-load"]
    stage_names = sorted({k for m in staged for st in data[m]["stages"] for k in st})
    report.tables.append(Table(
        f"Publish call → first completion served by the new weights (vLLM 0.32 CPU, tiny Llama, r8 adapter {fmt_bytes(adapters[0].nbytes)}; median of {repeats} interleaved rounds after {warmup} warm-up; ms)",
        ["mode", "publish call", "first completion", "total", "first token = trainer's"],
        rows,
    ))
    report.tables.append(Table(
        "Inside the publish call (PublishReport timings, median ms; preflight includes the capacity check and pre-retirement)",
        ["mode", *stage_names],
        [[m, *[fmt_ms(statistics.median([st.get(k, 0.0) for st in data[m]["stages"]])) if any(k in st for st in data[m]["stages"]) else "–" for k in stage_names]] for m in staged],
    ))
    orows = []
    for endpoint, (raw, client) in overhead.items():
        diff = client.median - raw.median
        orows.append([endpoint, fmt_ms(raw.median), fmt_ms(client.median), f"{diff * 1e3:+.2f}"])
        report.goals.append(Goal(f"client overhead: {endpoint} (ms)", diff * 1e3, 10.0))
    report.tables.append(Table(
        f"Client-side overhead: the same request through bare httpx vs VLLMEngine (median of {repeats} interleaved rounds; ms)",
        ["endpoint", "raw httpx", "lorasync client", "overhead"],
        orows,
    ))
    for mode in modes:
        if not all(data[mode]["served_new"]):
            report.notes.append(f"{mode}: some first completions did not match the trainer's token (see JSON): the engine served stale or wrong weights then.")
    report.notes += [
        f"Server start-up {startup:.0f} s (not counted). 'publish call' is Publisher.publish (keep=2; it returns once the new version serves: unloading the version two steps back follows in the background, awaited by the next publish) or, for unload-then-load, Adapter.save + unload + load of one fixed name.",
        "Two trained adapters alternate (different seeds), so each version changes the served token; the check compares with the trainer's own greedy token.",
        f"Prompt {prompt}; one generated token (max_tokens=1, temperature 0).",
    ]
    report.data = {"modes": data, "overhead": {k: {"raw": r.to_dict(), "client": c.to_dict()} for k, (r, c) in overhead.items()}, "startup_s": startup, "prompt": prompt}
    # The benchmark of record: the peer case on a non-toy model (its own server, after this one).
    peer = run_peer(opts, tmp / "peer", python, repeats, warmup)
    report.tables[:0] = peer["tables"]
    report.goals[:0] = peer["goals"]
    report.notes += peer["notes"]
    report.data["peer"] = peer["data"]
    report.plot = lambda fig: _plot(fig, data, overhead, peer["data"])
    return report


def _http(engine_args: tuple[Path, Path, Path], adapters: list[Any], refs: list[int], prompt: list[int], repeats: int, warmup: int, show: bool, inproc: InProcessCase | None) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]], float]:
    """The HTTP rows: a vLLM server, the four modes interleaved, then client overhead."""
    from lorasync.engines import connect
    from lorasync.testing.vllm_server import VLLMServer

    base_dir, python, tmp = engine_args
    say(f"starting a vLLM CPU server on the tiny model (about a minute on a small CPU box; log {tmp / 'vllm.log'})", show=show)
    t0 = time.perf_counter()
    with VLLMServer(
        base_dir,
        python=python,
        served_model_name=SERVED_BASE,
        log_path=tmp / "vllm.log",
        extra_args=("--worker-extension-cls", "lorasync.engines.vllm_worker.LoraSyncWorkerExtension"),
    ) as server:
        startup = time.perf_counter() - t0
        say(f"vLLM server up after {startup:.0f} s at {server.url}; first request (it compiles)", show=show)
        engine = connect("vllm", server.url, timeout=120)
        engine.generate(prompt, model=SERVED_BASE, max_tokens=1)  # first request compiles
        if inproc is not None:
            say("waiting for the in-process vllm.LLM to finish starting", show=show)
            inproc.wait_ready()  # idle from here on: the HTTP rounds have the box
        data = _measure_modes(("disk", "ipc", "merged", "unload-then-load"), engine, adapters, refs, prompt, tmp, base_dir, repeats, warmup, show)
        overhead = _client_overhead(engine, server.url, adapters[0], tmp / "overhead", prompt, repeats, warmup, show)
        engine.close()
    return data, overhead, startup


def _trainers(base_dir: Path, seeds: tuple[int, ...]) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    from lorasync.exporters.fsdp import export
    from lorasync.testing import make_peft_model

    out = []
    for seed in seeds:
        model = make_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), r=8, alpha=16, seed=seed)
        out.append({"model": model, "adapter": export(model)})
    return out


def _next_token(model: Any, prompt: list[int]) -> int:
    with torch.no_grad():
        return int(model(torch.tensor([prompt])).logits[0, -1].argmax())


def _pick_prompt(trainers: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """A prompt on which the alternating adapters give different next tokens."""
    for prompt in PROMPTS:
        refs = [_next_token(t["model"], list(prompt)) for t in trainers]
        if len(set(refs)) == len(refs):
            return list(prompt), refs
    prompt = list(PROMPTS[0])
    return prompt, [_next_token(t["model"], prompt) for t in trainers]


class _Mode:
    """One way to get new weights served; ``step(i)`` publishes version ``i`` and times it."""

    def __init__(self, mode: str, engine: Any, root: Path, base_dir: Path) -> None:
        from lorasync import Publisher

        self.mode, self.engine, self.root = mode, engine, root
        self.samples: dict[str, list[Any]] = {"publish": [], "first": [], "total": [], "served_new": [], "token": [], "stages": []}
        self.pub = None if mode == "unload-then-load" else Publisher([engine], name=f"bench-{mode}", transport=mode, root=root, keep=2, base=base_dir if mode == "merged" else None)
        self.loaded = False

    def step(self, i: int, adapters: list[Any], refs: list[int], prompt: list[int], record: bool) -> None:
        from lorasync import Adapter

        which = i % 2
        adapter = Adapter(adapters[which].tensors, adapters[which].config)  # hash not cached
        start = time.perf_counter()
        if self.pub is not None:
            report = self.pub.publish(adapter, version=i + 1).raise_for_errors()
            model = report.served_name if self.mode != "merged" else SERVED_BASE
            stages = {**{k: v for k, v in report.timings.items() if k != "total"}, **report.results[0].timings}
        else:
            path = adapter.save(self.root / f"v{i + 1}")
            if self.loaded:
                self.engine.unload_adapter("naive")
            self.engine.load_adapter("naive", path)
            self.loaded, model, stages = True, "naive", {}
        published = time.perf_counter()
        completion = self.engine.generate(prompt, model=model, max_tokens=1, logprobs=None)
        done = time.perf_counter()
        if record:
            token = int(completion.token_ids[0])
            for key, value in (("publish", published - start), ("first", done - published), ("total", done - start), ("token", token), ("served_new", token == refs[which]), ("stages", stages)):
                self.samples[key].append(value)

    def close(self) -> None:
        if self.pub is not None:
            if self.mode == "merged":
                self.pub.restore_base()
            for served in self.engine.list_adapters():
                if served.startswith(f"bench-{self.mode}@"):
                    self.engine.unload_adapter(served)
        elif self.loaded:
            self.engine.unload_adapter("naive")


def _measure_modes(modes: tuple[str, ...], engine: Any, adapters: list[Any], refs: list[int], prompt: list[int], tmp: Path, base_dir: Path, repeats: int, warmup: int, show: bool) -> dict[str, dict[str, list[Any]]]:
    """Round-robin over the adapter modes (each sees the same background load); ``warmup`` rounds untimed."""
    out: dict[str, dict[str, list[Any]]] = {}
    # A merged publish changes the base every adapter applies to: run it alone, after the adapter
    # modes, then restore the pristine base.
    for group in ([m for m in modes if m != "merged"], [m for m in modes if m == "merged"]):
        runners = {mode: _Mode(mode, engine, tmp / mode, base_dir) for mode in group}
        try:
            for i in progress(range(warmup + repeats), desc=f"vLLM rounds ({', '.join(group)})", show=show):
                for runner in runners.values():
                    runner.step(i, adapters, refs, prompt, record=i >= warmup)
        finally:
            for runner in runners.values():
                runner.close()
        out.update({mode: runner.samples for mode, runner in runners.items()})
    return {mode: out[mode] for mode in modes if mode in out}


def _client_overhead(engine: Any, url: str, adapter: Any, root: Path, prompt: list[int], repeats: int, warmup: int, show: bool) -> dict[str, tuple[Any, Any]]:
    """Per endpoint, (raw httpx timing, client timing) of identical requests, interleaved."""
    import httpx

    path = str(adapter.save(root / "adapter").resolve())
    body = {"model": SERVED_BASE, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    raw = httpx.Client(base_url=url, timeout=120)

    def check(response: httpx.Response) -> None:
        if response.status_code != 200:
            raise RuntimeError(f"raw {response.request.method} {response.request.url.path}: {response.status_code} {response.text[:200]}")

    cases = {
        "raw list": Case(lambda: check(raw.get("/v1/models"))),
        "client list": Case(engine.list_adapters),
        # Publisher.publish runs asyncio.run() per call: the async client path in a fresh loop.
        "raw alist": Case(lambda: check(raw.get("/v1/models"))),
        "client alist": Case(lambda: asyncio.run(engine.alist_adapters())),
        "raw load": Case(lambda: check(raw.post("/v1/load_lora_adapter", json={"lora_name": "ovh-raw", "lora_path": path})), teardown=lambda: engine.unload_adapter("ovh-raw")),
        "client load": Case(lambda: engine.load_adapter("ovh-client", path), teardown=lambda: engine.unload_adapter("ovh-client")),
        "raw unload": Case(lambda: check(raw.post("/v1/unload_lora_adapter", json={"lora_name": "ovh-raw"})), setup=lambda: engine.load_adapter("ovh-raw", path)),
        "client unload": Case(lambda: engine.unload_adapter("ovh-client"), setup=lambda: engine.load_adapter("ovh-client", path)),
        "raw completion": Case(lambda: check(raw.post("/v1/completions", json=body))),
        "client completion": Case(lambda: engine.generate(prompt, model=SERVED_BASE, max_tokens=1, logprobs=None)),
    }
    try:
        times = timeit_many(cases, repeats=repeats, warmup=warmup, label="client overhead (rounds)", show=show)
    finally:
        raw.close()
    endpoints = {"GET /v1/models (list_adapters)": "list", "GET /v1/models (alist_adapters in a fresh event loop, as each Publisher.publish)": "alist", "POST /v1/load_lora_adapter (load_adapter)": "load", "POST /v1/unload_lora_adapter (unload_adapter)": "unload", "POST /v1/completions (generate)": "completion"}
    return {label: (times[f"raw {key}"], times[f"client {key}"]) for label, key in endpoints.items()}


def _plot(fig: Any, data: dict[str, dict[str, list[Any]]], overhead: dict[str, tuple[Any, Any]], peer: dict[str, Any]) -> None:
    fig.set_size_inches(18, 6)
    ax0, ax1, ax2 = fig.subplots(1, 3, width_ratios=[3, 3, 2])
    plot_peer(ax0, peer)
    modes = list(data)
    pub = [statistics.median(data[m]["publish"]) * 1e3 for m in modes]
    first = [statistics.median(data[m]["first"]) * 1e3 for m in modes]
    ax1.barh(modes, pub, color="#4a90d9", label="publish call")
    ax1.barh(modes, first, left=pub, color="#f0a040", label="first completion")
    ax1.set_xlabel("ms (median)")
    ax1.set_title("Publish → first completion on the new weights")
    ax1.invert_yaxis()
    ax1.legend(fontsize=8)
    ax1.grid(True, axis="x", alpha=0.3)
    labels = [k.split(" (")[1].split(" in a fresh")[0].rstrip(")") + (" (fresh loop)" if "fresh" in k else "") for k in overhead]
    diffs = [(c.median - r.median) * 1e3 for r, c in overhead.values()]
    ax2.barh(labels, diffs, color=["#1f5fa8" if d <= 10 else "#d9534f" for d in diffs])
    ax2.axvline(10, color="gray", linestyle="--", label="goal ≤ 10 ms")
    ax2.axvline(0, color="black", linewidth=0.8)
    ax2.set_xlabel("client − raw httpx (ms, median)")
    ax2.set_title("lorasync client overhead per endpoint")
    ax2.invert_yaxis()
    ax2.legend(fontsize=8)
    ax2.grid(True, axis="x", alpha=0.3)


if __name__ == "__main__":  # pragma: no cover
    from benchmarks._runner import main

    raise SystemExit(main(NAME))
