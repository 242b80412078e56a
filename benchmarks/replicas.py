"""Replicas: publish → every replica serving, for 1, 2 and 4 real vLLM CPU servers behind vLLM's
own router (``vllm-router``), against the way users do it today: ``save_pretrained``, then a
``/v1/load_lora_adapter`` per replica by hand, one after another.

Each round the trainer takes a step (a distinct adapter), then each way syncs it and the clock
stops when every replica has answered one completion under the new name, sent straight to each
replica at once (the first use also activates the adapter in its slots). Every completion's first
token is checked against the trainer's own greedy token, so "serving" is verified, not assumed.
All (way, replicas) cases run interleaved, round by round. lorasync is given only the router's
URL (``vllm-router:URL``): it lists the workers and publishes to each.

The servers share this host's cores (each engine bound to a core of its own, round robin), so
four replicas load at once on two cores here; on a real fleet each replica has its own.
Goal (issue 36): 4 replicas ≤ 1.3× one replica.

Run: ``lorasync bench replicas [--engines 1,2,4]``.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks._harness import Goal, Options, Report, Table, fmt_ms, say

__all__ = ["run"]

NAME = "replicas"
SIZES = (1, 2, 4)
WAYS = {"lorasync": "lorasync (vllm-router:URL, disk)", "peer": "save_pretrained + a load per replica"}
PROMPT = [5, 17, 99, 230, 41]
EXTENSION = ("--worker-extension-cls", "lorasync.engines.vllm_worker.LoraSyncWorkerExtension")


def run(opts: Options) -> Report:
    from lorasync.testing.venvs import engine_venv

    title = "Replicas: publish → every replica serving (real vLLM CPU servers behind vllm-router)"
    venv = engine_venv("vllm")
    if not venv.ready:
        return Report(NAME, title, skipped=venv.problem)
    sizes = sorted(set(opts.engines)) or list(SIZES)
    repeats, warmup = opts.reps(6, 2), opts.warm(1, 1)
    if repeats < 1:
        raise ValueError(f"bench replicas needs at least one measured round (--repeats {repeats})")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="lorasync-bench-replicas-") as tmp:
            return _run(opts, Path(tmp), venv.python, sizes, repeats, warmup, title)
    finally:
        torch.set_num_threads(before)


def _run(opts: Options, tmp: Path, python: Path, sizes: list[int], repeats: int, warmup: int, title: str) -> Report:
    from lorasync import Publisher
    from lorasync.exporters.fsdp import export
    from lorasync.testing import make_peft_model, make_tiny_model
    from lorasync.testing.vllm_router import VLLMRouterProcess
    from lorasync.testing.vllm_server import VLLMServer, free_port, start_all

    show = opts.progress
    base_dir = tmp / "base"
    make_tiny_model(base_dir)
    model = make_peft_model(make_tiny_model(), r=8, seed=3)
    cpus = sorted(os.sched_getaffinity(0))
    servers = [
        VLLMServer(
            base_dir, python=python, port=free_port(), served_model_name="tiny-base", extra_args=EXTENSION, log_path=tmp / f"worker{i}.log",
            env={"VLLM_CPU_OMP_THREADS_BIND": str(cpus[i % len(cpus)])},
        )
        for i in range(max(sizes))
    ]
    say(f"starting {len(servers)} vLLM CPU servers and {len(sizes)} routers", show=show)
    routers: dict[int, Any] = {}
    pubs: dict[int, Any] = {}
    clients: list[httpx.Client] = []
    pool = concurrent.futures.ThreadPoolExecutor(max(sizes))
    peer_names: dict[int, list[str]] = {n: [] for n in sizes}
    samples: dict[str, list[float]] = {f"{w}:{n}": [] for w in WAYS for n in sizes}
    sync: dict[str, list[float]] = {k: [] for k in samples}  # the sync call alone (publish / save + loads)
    exact: dict[str, list[bool]] = {k: [] for k in samples}
    try:
        start_all(servers)
        for n in sizes:
            routers[n] = VLLMRouterProcess([s.url for s in servers[:n]], log_path=tmp / f"router{n}.log").start()
            pubs[n] = Publisher([f"vllm-router:{routers[n].url}"], name=f"rep{n}", keep=2, root=tmp / f"pub{n}", transport="disk")
        clients += [httpx.Client(base_url=s.url, timeout=120) for s in servers]

        def first_tokens(n: int, name: str) -> list[int]:
            body = {"model": name, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0, "return_token_ids": True}

            def one(client: httpx.Client) -> int:
                response = client.post("/v1/completions", json=body)
                if response.status_code != 200:
                    raise RuntimeError(f"{client.base_url}: {response.status_code} {response.text[:200]}")
                return int(response.json()["choices"][0]["token_ids"][0])

            return list(pool.map(one, clients[:n]))

        for i in range(warmup + repeats):
            with torch.no_grad():  # the trainer's step: a distinct adapter every round
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.add_(1e-2 * (i + 1))
                want = int(model(torch.tensor([PROMPT])).logits[0, -1].argmax())
            cases = [(w, n) for n in sizes for w in WAYS]
            cases = cases[i % len(cases) :] + cases[: i % len(cases)]
            for way, n in cases:
                start = time.perf_counter()
                report = None
                if way == "lorasync":
                    report = pubs[n].publish(export(model), version=i + 1).raise_for_errors()
                    name = report.served_name
                else:
                    path = tmp / f"peer{n}" / f"step{i}"
                    model.save_pretrained(str(path))
                    name = f"peer{n}-{i}"
                    for client in clients[:n]:  # by hand: one load per replica
                        response = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
                        if response.status_code != 200:
                            raise RuntimeError(f"peer load: {response.status_code} {response.text[:200]}")
                synced = time.perf_counter()
                tokens = first_tokens(n, name)
                elapsed = time.perf_counter() - start
                if report is not None:
                    # The retirement of the version before runs in the background; a trainer's next
                    # publish comes a training step later and finds it done. Here the next round
                    # comes at once, so it is let finish outside the clock.
                    report.settled()
                if way == "peer":
                    peer_names[n].append(name)
                    while len(peer_names[n]) > 2:  # keep two, as the publisher does
                        old = peer_names[n].pop(0)
                        for client in clients[:n]:
                            client.post("/v1/unload_lora_adapter", json={"lora_name": old})
                        shutil.rmtree(tmp / f"peer{n}" / f"step{old.rsplit('-', 1)[1]}", ignore_errors=True)
                if i >= warmup:
                    samples[f"{way}:{n}"].append(elapsed)
                    sync[f"{way}:{n}"].append(synced - start)
                    exact[f"{way}:{n}"].append(all(t == want for t in tokens))
            say(f"round {i + 1}/{warmup + repeats}", show=show)
    finally:
        pool.shutdown()
        for c in clients:
            c.close()
        for pub in pubs.values():
            pub.close()
        for router in routers.values():
            router.stop()
        for server in servers:
            server.stop()

    med = {k: statistics.median(v) for k, v in samples.items()}
    one = sizes[0]
    rows = []
    for n in sizes:
        for way, label in WAYS.items():
            k = f"{way}:{n}"
            rows.append([label, n, fmt_ms(statistics.median(sync[k])), fmt_ms(med[k]), f"{med[k] / med[f'{way}:{one}']:.2f}", f"{med[k] / med[f'peer:{n}']:.2f}", f"{sum(exact[k])}/{len(exact[k])}"])
    report = Report(NAME, title)
    report.tables.append(Table(
        f"Trainer step → every replica answered under the new name (median of {repeats} interleaved rounds, ms)",
        ["way", "replicas", "sync call", "until every replica answered", f"× {one} replica", "× peer", "first token = trainer's"],
        rows,
    ))
    largest = sizes[-1]
    report.goals.append(Goal(f"lorasync: {largest} replicas / {one}", med[f"lorasync:{largest}"] / med[f"lorasync:{one}"], 1.3, "publish to every worker the router lists, concurrently"))
    report.notes += [
        f"{len(servers)} vLLM CPU servers (tiny Llama, lorasync's worker extension), each engine bound to one of this host's {len(cpus)} cores round robin; one vllm-router per replica count.",
        "The peer loads one replica after another, as a hand-written loop over the replicas' URLs does; its adapter files are written once with save_pretrained; it unloads the version before last after the clock stopped.",
        "lorasync's retirement of the version before last (in the background) is let finish after the clock stopped, as a training step would.",
        f"torch intra-op threads: {torch.get_num_threads()}.",
    ]
    report.data = {"sizes": sizes, "samples_s": samples, "sync_s": sync, "exact": exact}
    report.plot = lambda fig: _plot(fig, med, sizes)
    return report


def _plot(fig: Any, med: dict[str, float], sizes: list[int]) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    for i, (way, label) in enumerate(WAYS.items()):
        ys = [med[f"{way}:{n}"] * 1e3 for n in sizes]
        ax1.plot(sizes, ys, "o-", color=f"C{i}", label=label)
        ax2.plot(sizes, [y / ys[0] for y in ys], "o-", color=f"C{i}", label=label)
    ax2.axhline(1.3, color="gray", linestyle="--", label="goal (lorasync): ≤ 1.3×")
    for ax in (ax1, ax2):
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("replicas")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax1.set_ylabel("step → every replica serving (ms, median)")
    ax2.set_ylabel(f"× {sizes[0]} replica")


if __name__ == "__main__":  # pragma: no cover
    from benchmarks._runner import main

    raise SystemExit(main(NAME))
