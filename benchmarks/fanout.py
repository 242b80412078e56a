"""Fan-out: one publish to 1, 2, 4, 8 engines, wall time relative to one engine.

Each engine is a counting engine whose load takes a fixed engine-side time (``--load-ms``
stand-in for the engine's own work on its own hardware; it sleeps, so eight of them do not fight
this host's CPUs). What scales is lorasync's part: the disk transport writes a version once for
all engines and loads them concurrently; the IPC transport writes one shared-memory segment for
all engines of a publish; the merged fallback folds once and pushes the same buckets to every
engine. Goal (issue #5): fan-out to 8 engines
≤ 1.5× one engine.

Run: ``lorasync bench fanout [--engines 1,2,4,8] [--shape S] [--rank R]`` or ``python -m benchmarks.fanout``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks._engines import CountingEngine
from benchmarks._harness import Case, Goal, Options, Report, Table, fmt_bytes, fmt_ms, timeit_many
from benchmarks._shapes import ModelShape
from benchmarks._synth import synth_adapter, synth_base_tensors
from lorasync import Adapter, BaseWeights, Publisher
from lorasync.testing import MemoryEngine

__all__ = ["run"]

NAME = "fanout"
ENGINES = (1, 2, 4, 8)
SCENARIOS = {
    "disk/counting": "disk → counting engines",
    "ipc/counting": "ipc → counting engines",
    "merged/counting": "merged → counting engines",
    "disk/memory": "disk → MemoryEngine",
    "ipc/memory": "ipc → MemoryEngine",
}
LOAD_S = 0.05  # engine-side load time of each fake engine
MERGED_LAYERS = 1
MERGED_SCOPE = "attention"


def run(opts: Options) -> Report:
    shape = ModelShape.load(opts.shapes[0] if opts.shapes else "qwen3-8b")
    rank = opts.ranks[0] if opts.ranks else 16
    scope = opts.scope or "all-linear"
    sizes = sorted(set(opts.engines)) or list(ENGINES)
    repeats, warmup = opts.reps(7, 3), opts.warm(1, 1)
    adapter = synth_adapter(shape, rank=rank, scope=scope)
    # The merged fallback folds whole base weights per engine: a one-layer attention slice keeps
    # it short (the per-engine cost is what scales).
    small = synth_adapter(shape, rank=rank, scope=MERGED_SCOPE, layers=range(MERGED_LAYERS))
    base = BaseWeights.from_tensors(synth_base_tensors(shape, scope=MERGED_SCOPE, layers=range(MERGED_LAYERS)))
    report = Report(NAME, f"Fan-out: one publish to N engines ({shape.name} r{rank} {scope}, {fmt_bytes(adapter.nbytes)}; engine-side load {LOAD_S * 1e3:.0f} ms each)")
    parent = str(opts.root) if opts.root else ("/dev/shm" if Path("/dev/shm").is_dir() else None)
    state: dict[str, Any] = {}

    with tempfile.TemporaryDirectory(prefix="lorasync-bench-fanout-", dir=parent) as tmp:
        root = Path(tmp)

        def setup(scenario: str, n: int) -> None:
            transport, kind = scenario.split("/")
            src = small if transport == "merged" else adapter
            state["adapter"] = Adapter(src.tensors, src.config)  # hash not cached
            engines = [CountingEngine(load_delay=LOAD_S) if kind == "counting" else MemoryEngine() for _ in range(n)]
            state["pub"] = Publisher(engines, name="fan", transport=transport, root=root / "pub", base=base if transport == "merged" else None)

        def publish() -> None:
            state["pub"].publish(state["adapter"], version=1).raise_for_errors()

        def teardown() -> None:
            state["pub"].close()
            shutil.rmtree(root / "pub", ignore_errors=True)

        cases = {}
        for scenario in SCENARIOS:
            for n in sizes:
                cases[f"{scenario}:{n}"] = Case(publish, setup=lambda sc=scenario, n=n: setup(sc, n), teardown=teardown)
        times = timeit_many(cases, repeats=repeats, warmup=warmup, label="fan-out (rounds)", show=opts.progress)

    rows = []
    data: dict[str, Any] = {}
    for scenario in SCENARIOS:
        one = times[f"{scenario}:{sizes[0]}"].median
        for n in sizes:
            t = times[f"{scenario}:{n}"]
            data[f"{scenario}:{n}"] = t.to_dict()
            rows.append([SCENARIOS[scenario], n, fmt_ms(t.median), f"{t.median / one:.2f}", f"{t.median / (n / sizes[0] * one):.2f}"])
    report.tables.append(Table(
        f"Publish wall time vs engines (median of {repeats} rounds, all configurations interleaved; ms)",
        ["transport → engines", "engines", "ms", f"× {sizes[0]} engine(s)", "× linear"],
        rows,
    ))
    largest = sizes[-1]
    for scenario, detail in (("disk/counting", "one write, concurrent loads"), ("ipc/counting", "one shared-memory segment per publish"), ("merged/counting", "one fold per publish, same buckets to every engine")):
        ratio = times[f"{scenario}:{largest}"].median / times[f"{scenario}:{sizes[0]}"].median
        report.goals.append(Goal(f"{scenario.split('/')[0]}: {largest} engines / {sizes[0]}", ratio, 1.5, detail))
    report.notes += [
        "Counting engines: a real Engine subclass driven by the Publisher like any client, whose load sleeps for the engine-side time, so the rows measure lorasync's fan-out, not the engines (goals apply to these).",
        "MemoryEngine rows (lorasync.testing): in-process engines whose disk loads read the files with Adapter.load on this host's CPUs, so eight of them share two cores; their tensor loads keep the Adapter object (no copy).",
        f"Merged rows fold the {MERGED_SCOPE} modules of {MERGED_LAYERS} layer ({fmt_bytes(shape.merged_bytes(MERGED_SCOPE, layers=range(MERGED_LAYERS)))} of weights per engine).",
        f"torch intra-op threads: {torch.get_num_threads()}.",
    ]
    report.data = {"shape": shape.name, "rank": rank, "scope": scope, "sizes": sizes, "load_s": LOAD_S, "timings": data}
    report.plot = lambda fig: _plot(fig, times, sizes)
    return report


def _plot(fig: Any, times: dict[str, Any], sizes: list[int]) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    for i, (scenario, label) in enumerate(SCENARIOS.items()):
        style = "o-" if scenario.endswith("counting") else "s--"
        ys = [times[f"{scenario}:{n}"].median * 1e3 for n in sizes]
        ax1.plot(sizes, ys, style, color=f"C{i}", label=label)
        ax2.plot(sizes, [y / ys[0] for y in ys], style, color=f"C{i}", label=label)
    ax2.axhline(1.5, color="gray", linestyle="--", label="goal: ≤ 1.5×")
    ax2.plot(sizes, [n / sizes[0] for n in sizes], ":", color="lightgray", label="linear")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("engines")
        ax.grid(True, alpha=0.3)
    ax1.set_yscale("log")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    ax1.set_ylabel("publish wall time (ms, median)")
    ax1.set_title("Publish wall time")
    ax2.set_ylabel(f"× {sizes[0]} engine(s)")
    ax2.set_title("Scaling")


if __name__ == "__main__":  # pragma: no cover
    from benchmarks._runner import main

    raise SystemExit(main(NAME))
