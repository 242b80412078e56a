"""Regression: this checkout's lorasync against an earlier revision's, in one run, interleaved.

Issue 28 asks that speed stays: ``bench publish`` and ``bench vllm`` within 5 % of run D, the
benchmark of record made at commit ``09898ca``. Numbers from runs made on other days cannot
answer that on a shared 2-core box (the reference box's absolute times move by ±30 % between
runs, and the engine's share of a round moves with the load, so even ratios to the peer drift).
So both versions run here side by side: the older ``lorasync/`` is taken out of git history as
``lorasync_base`` (:mod:`benchmarks._baseline`), and each round runs the same operation on the
same tensors with one version, then the other, in alternating order.

Three cases, each the measurement of record of its benchmark:

* ``publish`` — the every-step loop ``pub.publish(adapter, version=step)`` on the disk transport
  (tmpfs) to an engine that does nothing (so only lorasync's own work counts), alternating two
  adapters of the model shape; and a fresh ``Publisher``'s first publish. Wall time of the call
  plus its background retirement (``report.settled()``).
* ``fleet`` — a Fleet round of 16 tenants on the disk transport to an engine that does nothing,
  every tenant passed and one changed (``bench fleet``'s "fleet-changed" case, the one issue 33
  asks to keep), and a round where all 16 changed.
* ``vllm`` — the benchmark of record's loop on a real vLLM CPU server (``llama-10mb``, a 9.6 MB
  r16 all-linear adapter): ``publish(fsdp.export(model))``, then one completion on the new
  version whose token is checked against the trainer's. The peer (``save_pretrained`` + load +
  unload of step-2) runs in the same rounds for reference.

The goal is the median of the per-round ratios (this checkout / baseline) ≤ 1.05; each comes
with a 95 % bootstrap interval, which says how much of a difference the box's noise alone makes.

Run: ``lorasync bench regression [--against REV] [--quick]`` (default ``--against 09898ca``); it
needs a git checkout, and the vLLM case the engine venv (``scripts/engine-venv.sh``).
"""

from __future__ import annotations

import importlib
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from benchmarks._baseline import load_baseline
from benchmarks._harness import Goal, Options, Report, Table, fmt_ms, progress, say
from benchmarks._shapes import ModelShape
from benchmarks._synth import synth_adapter

__all__ = ["RUN_D", "run"]

NAME = "regression"
RUN_D = "09898ca"  # the benchmark of record (docs/benchmarks.md, run D)
LIMIT = 1.05


def run(opts: Options) -> Report:
    rev = opts.against or RUN_D
    title = f"Regression: this checkout against {rev}, interleaved in one run"
    tmp = Path(tempfile.mkdtemp(prefix="lorasync-bench-regression-"))
    try:
        try:
            base, sha = load_baseline(rev, tmp / "baseline")
        except RuntimeError as exc:
            return Report(NAME, title, skipped=str(exc))
        import lorasync

        versions = {"base": base, "head": lorasync}
        report = Report(NAME, f"Regression: this checkout against {sha[:9]} ({rev}), interleaved in one run")
        report.data["against"] = sha
        _publish_case(opts, report, versions, tmp)
        _fleet_case(opts, report, versions, tmp)
        _vllm_case(opts, report, versions, tmp)
        report.notes.append("Each round runs the same operation with both versions, in alternating order; the ratio is this checkout / baseline per round, and the goal takes their median.")
        return report
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fleet_case(opts: Options, report: Report, versions: dict[str, ModuleType], tmp: Path) -> None:
    shape = ModelShape.load(opts.shapes[0] if opts.shapes else "qwen3-0.6b")
    rank = opts.ranks[0] if opts.ranks else 16
    tenants = 16
    repeats, warmup = opts.reps(12, 4), opts.warm(2, 1)
    adapters = [synth_adapter(shape, rank=rank, scope="all-linear", dtype=torch.bfloat16, seed=s) for s in range(tenants)]
    parent = opts.root or (Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp)
    root = Path(tempfile.mkdtemp(prefix="lorasync-bench-regression-fleet-", dir=parent))
    os.chmod(root, 0o700)
    engines = {k: _noop_engine(pkg) for k, pkg in versions.items()}
    fleets: dict[str, Any] = {}
    cpu: dict[str, dict[str, list[float]]] = {"one": {k: [] for k in versions}, "all": {k: [] for k in versions}}
    names = [f"t{i}" for i in range(tenants)]
    try:
        for k, pkg in versions.items():
            fleet = pkg.Fleet([engines[k]()], transport="disk", root=root / k)
            for name in names:
                fleet.register(name, keep=1, grace=0.0)
            own = [pkg.Adapter(a.tensors, a.config) for a in adapters]
            fleet.publish(dict(zip(names, own)), versions=dict.fromkeys(names, 0)).raise_for_errors()
            fleets[k] = (fleet, own)
        version = 0
        for i in progress(range(warmup + repeats), desc="regression: fleet rounds", show=opts.progress):
            for what in ("one", "all"):
                version += 1
                with torch.no_grad():  # the trainers step: tenant 0 alone, or every tenant
                    for a in adapters[: 1 if what == "one" else tenants]:
                        next(iter(a.tensors.values())).add_(1)
                order = list(versions) if i % 2 else list(versions)[::-1]
                for k in order:
                    fleet, own = fleets[k]
                    start = time.process_time()
                    fleet.publish(dict(zip(names, own)), versions=dict.fromkeys(names, version)).raise_for_errors()
                    if i >= warmup:
                        cpu[what][k].append(time.process_time() - start)
    finally:
        for fleet, _ in fleets.values():
            fleet.close()
        shutil.rmtree(root, ignore_errors=True)
    label = f"{tenants} tenants of {shape.name} r{rank} all-linear bf16, {adapters[0].nbytes / 1e6:.1f} MB each"
    rows = []
    for what, title in (("one", "round, one tenant changed"), ("all", "round, every tenant changed")):
        ratio = _paired(cpu[what])
        low, high = _interval(cpu[what])
        rows.append([title, fmt_ms(statistics.median(cpu[what]["base"])), fmt_ms(statistics.median(cpu[what]["head"])), f"{ratio:.2f} ({low:.2f}–{high:.2f})"])
        report.goals.append(Goal(f"fleet: {title}, this checkout / baseline (CPU time)", ratio, LIMIT, f"{label}; 95 % interval {low:.2f}–{high:.2f}"))
    report.tables.append(Table(f"Fleet rounds to an engine that does nothing ({label}; tmpfs; median of {repeats} rounds; CPU ms)", ["case", "baseline", "this checkout", "paired ratio (95 % interval)"], rows))
    report.data["fleet"] = {"shape": shape.name, "rank": rank, "tenants": tenants, "cpu": cpu}


def _noop_engine(pkg: ModuleType) -> type:
    """An engine of ``pkg``'s own base class that does nothing: only lorasync's work is timed."""
    base = _sub(pkg, "engines._engine")

    class Noop(base.Engine):  # type: ignore[name-defined,misc]
        kind = "noop"

        def __init__(self) -> None:
            self._served: dict[str, str | None] = {}

        def capabilities(self) -> Any:
            return base.Capabilities(engine="noop", tensor_load=True)

        def load_adapter(self, name: str, path: Any) -> None:
            self._served[name] = str(path)

        def load_adapter_tensors(self, name: str, adapter: Any) -> None:
            self._served[name] = None

        def unload_adapter(self, name: str) -> None:
            self._served.pop(name)

        def list_adapters(self) -> list[str]:
            return sorted(self._served)

    return Noop


def _sub(pkg: ModuleType, sub: str) -> ModuleType:
    """``pkg``'s submodule ``sub`` (the baseline's or this checkout's)."""
    return importlib.import_module(f"{pkg.__name__}.{sub}")


def _paired(samples: dict[str, list[float]]) -> float:
    """Median over rounds of this checkout's time / the baseline's in the same round."""
    return statistics.median(h / b for h, b in zip(samples["head"], samples["base"]))


def _interval(samples: dict[str, list[float]], *, draws: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval of :func:`_paired` (rounds resampled; a fixed seed, so a report
    can be reproduced from its JSON): how far the box's noise alone moves the ratio."""
    ratios = [h / b for h, b in zip(samples["head"], samples["base"])]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def _publish_case(opts: Options, report: Report, versions: dict[str, ModuleType], tmp: Path) -> None:
    shape = ModelShape.load(opts.shapes[0] if opts.shapes else ("qwen3-0.6b" if opts.quick else "qwen3-8b"))
    rank = opts.ranks[0] if opts.ranks else 16
    repeats, warmup = opts.reps(20, 4), opts.warm(2, 1)
    pair = [synth_adapter(shape, rank=rank, scope="all-linear", dtype=torch.bfloat16, seed=s) for s in (0, 1)]
    parent = opts.root or (Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp)
    root = Path(tempfile.mkdtemp(prefix="lorasync-bench-regression-", dir=parent))
    os.chmod(root, 0o700)
    engines = {k: _noop_engine(pkg) for k, pkg in versions.items()}
    steady = {k: pkg.Publisher([engines[k]()], name="steady", transport="disk", root=root / f"{k}-steady", keep=2) for k, pkg in versions.items()}
    step_s: dict[str, list[float]] = {k: [] for k in versions}
    fresh_s: dict[str, list[float]] = {k: [] for k in versions}

    cpu: dict[str, dict[str, list[float]]] = {"every_step": {k: [] for k in versions}, "fresh": {k: [] for k in versions}}

    def timed(call: Callable[[], Any], what: str, k: str, i: int) -> float:
        start, start_cpu = time.perf_counter(), time.process_time()
        call()
        took = time.perf_counter() - start
        if i >= warmup:
            cpu[what][k].append(time.process_time() - start_cpu)
        return took

    try:
        for i in progress(range(warmup + repeats), desc="regression: publish rounds", show=opts.progress):
            order = list(versions) if i % 2 else list(versions)[::-1]
            for k in order:
                pkg, src = versions[k], pair[i % 2]

                def every_step() -> None:
                    done = steady[k].publish(pkg.Adapter(src.tensors, src.config), version=i + 1)
                    if not done.ok:
                        raise RuntimeError(f"{k}: {done}")
                    getattr(done, "settled", lambda: None)()  # its background retirement counts

                took = timed(every_step, "every_step", k, i)
                if i >= warmup:
                    step_s[k].append(took)
            for k in order:
                pkg, src = versions[k], pair[0]
                pub = pkg.Publisher([engines[k]()], name="fresh", transport="disk", root=root / f"{k}-fresh{i}")

                def first() -> None:
                    done = pub.publish(pkg.Adapter(src.tensors, src.config), version=1)
                    if not done.ok:
                        raise RuntimeError(f"{k}: {done}")
                    getattr(done, "settled", lambda: None)()

                took = timed(first, "fresh", k, i)
                pub.close()
                shutil.rmtree(root / f"{k}-fresh{i}", ignore_errors=True)
                if i >= warmup:
                    fresh_s[k].append(took)
    finally:
        for pub in steady.values():
            pub.close()
        shutil.rmtree(root, ignore_errors=True)
    label = f"{shape.name} r{rank} all-linear bf16, {pair[0].nbytes / 1e6:.1f} MB"
    rows = []
    for what, key, samples in (("every-step publish (keep=2)", "every_step", step_s), ("fresh Publisher, first publish", "fresh", fresh_s)):
        ratio, cpu_ratio = _paired(samples), _paired(cpu[key])
        low, high = _interval(cpu[key])
        rows.append([
            what, fmt_ms(statistics.median(samples["base"])), fmt_ms(statistics.median(samples["head"])), f"{ratio:.2f}",
            fmt_ms(statistics.median(cpu[key]["base"])), fmt_ms(statistics.median(cpu[key]["head"])), f"{cpu_ratio:.2f} ({low:.2f}–{high:.2f})",
        ])
        report.goals.append(Goal(f"publish: {what}, this checkout / baseline (CPU time)", cpu_ratio, LIMIT, f"{label}; 95 % interval {low:.2f}–{high:.2f}; wall time {ratio:.2f}"))
    report.tables.append(Table(
        f"Disk publish to an engine that does nothing ({label}; tmpfs; median of {repeats} rounds; ms)",
        ["case", "wall: baseline", "wall: this checkout", "paired ratio", "CPU: baseline", "CPU: this checkout", "paired ratio (95 % interval)"], rows,
    ))
    report.notes.append(
        "publish: the goal takes CPU time (this process, every thread: the tmpfs write is system time), which a shared box "
        "moves far less than wall time; both are shown."
    )
    report.data["publish"] = {"shape": shape.name, "rank": rank, "every_step": step_s, "fresh": fresh_s, "cpu": cpu}


def _vllm_case(opts: Options, report: Report, versions: dict[str, ModuleType], tmp: Path) -> None:
    from lorasync.testing.venvs import engine_venv

    venv = engine_venv("vllm")
    if not venv.ready:
        report.notes.append(f"vllm case skipped: {venv.problem}")
        return
    import httpx

    from benchmarks.vllm_peer import PROMPTS, SERVED_BASE, _build, _next_token, _trainers
    from lorasync.testing.vllm_server import VLLMServer

    repeats, warmup = opts.reps(30, 3), opts.warm(2, 1)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference model is far faster on one thread of a busy box
    try:
        _build("llama-10mb", tmp / "base-model")
        trainers = _trainers(tmp / "base-model", seeds=(11, 12))
        prompt = next((list(p) for p in PROMPTS if len({_next_token(t, list(p)) for t in trainers}) == 2), list(PROMPTS[0]))
        refs = [_next_token(t, prompt) for t in trainers]
    finally:
        torch.set_num_threads(before)
    ways = ("peer", "base", "head")
    samples: dict[str, dict[str, list[float]]] = {w: {"publish": [], "first": [], "total": []} for w in ways}
    wrong: dict[str, int] = dict.fromkeys(ways, 0)
    say("regression: starting a vLLM CPU server on llama-10mb (a minute or more)", show=opts.progress)
    with VLLMServer(
        tmp / "base-model", python=venv.python, served_model_name=SERVED_BASE, max_lora_rank=16, max_loras=6, max_cpu_loras=8,
        log_path=tmp / "vllm.log", startup_timeout=600.0,
    ) as server:
        clients = {k: _sub(pkg, "engines").connect("vllm", server.url, timeout=300) for k, pkg in versions.items()}
        exports = {k: _sub(pkg, "exporters.fsdp").export for k, pkg in versions.items()}
        pubs = {k: pkg.Publisher([clients[k]], name=f"reg-{k}", root=tmp / f"store-{k}", keep=2) for k, pkg in versions.items()}
        raw = httpx.Client(base_url=server.url, timeout=300)
        peer_loaded: list[str] = []
        try:
            clients["head"].generate(prompt, model=SERVED_BASE, max_tokens=1)  # the first request compiles

            def step(way: str, i: int) -> str:
                model = trainers[i % 2]
                if way == "peer":
                    path = tmp / "peer" / f"step{i}"
                    model.save_pretrained(str(path))
                    raw.post("/v1/load_lora_adapter", json={"lora_name": f"peer-{i}", "lora_path": str(path)}).raise_for_status()
                    peer_loaded.append(f"peer-{i}")
                    if len(peer_loaded) > 2:
                        raw.post("/v1/unload_lora_adapter", json={"lora_name": peer_loaded.pop(0)}).raise_for_status()
                    return f"peer-{i}"
                return str(pubs[way].publish(exports[way](model), version=i + 1).raise_for_errors().served_name)

            for i in progress(range(warmup + repeats), desc="regression: vLLM rounds", show=opts.progress):
                order = ways[i % 3 :] + ways[: i % 3]
                for way in order:
                    start = time.perf_counter()
                    served = step(way, i)
                    published = time.perf_counter()
                    completion = clients["head"].generate(prompt, model=served, max_tokens=1, logprobs=None)
                    done = time.perf_counter()
                    if i >= warmup:
                        s = samples[way]
                        s["publish"].append(published - start)
                        s["first"].append(done - published)
                        s["total"].append(done - start)
                        wrong[way] += int(completion.token_ids[0]) != refs[i % 2]
                    # Background work a way left (lorasync's retirement of step-2) must not land
                    # on the next way's measurement; it still meets its own first completion.
                    time.sleep(0.3)
                shutil.rmtree(tmp / "peer" / f"step{i - 3}", ignore_errors=True)
        finally:
            for pub in pubs.values():
                pub.close()
            for client in clients.values():
                client.close()
            raw.close()
    rows = []
    peer_total = statistics.median(samples["peer"]["total"])
    for way in ways:
        s = samples[way]
        total = statistics.median(s["total"])
        rows.append([way, fmt_ms(statistics.median(s["publish"])), fmt_ms(statistics.median(s["first"])), f"**{fmt_ms(total)}**", f"{total / peer_total:.2f}", f"{repeats - wrong[way]}/{repeats}"])
    totals = {k: samples[k]["total"] for k in ("base", "head")}
    ratio, (low, high) = _paired(totals), _interval(totals)
    report.goals.append(Goal("vllm llama-10mb: publish → first completion, this checkout / baseline", ratio, LIMIT, f"real vLLM 0.32 CPU; 95 % interval {low:.2f}–{high:.2f}"))
    report.tables.append(Table(f"Real vLLM CPU, llama-10mb (9.6 MB r16 adapter): publish call → first completion on the new weights (median of {repeats} rounds; ms)", ["way", "publish call", "first completion", "total", "x peer", "first token = trainer's"], rows))
    report.data["vllm"] = {"samples": samples, "wrong_tokens": wrong}
    if any(wrong.values()):
        raise RuntimeError(f"some first completions did not serve the trainer's token: {wrong}")
