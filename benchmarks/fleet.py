"""Fleet: one publish round of N tenants on one engine when one of them changed, against N
separate Publishers publishing the same adapters.

Each tenant has its own adapter of the model shape, and only tenant 0's content changes between
rounds. Two ways to call the Fleet are timed on the same Fleet, interleaved:

* **all passed**: every round passes all N adapters. The Fleet hashes the N-1 unchanged ones to
  learn that they did not change (content, every byte, every round), and sends only the changed
  one. Hashing runs in threads and, on an engine without an adapter limit (this one), during the
  changed tenant's engine load.
* **only the changed one passed**: the trainer passes the tenants that stepped (a documented way
  to call ``Fleet.publish``); nothing is hashed for the others.

The N Publishers each run their own publish: an unchanged one moves no bytes to the engine, but
the disk transport still writes and hashes its files to learn that, then discards them. The
engine is a counting engine whose load takes a fixed engine-side time and which has no adapter
limit. Goal (issue #24): 16 tenants ≤ 1.2× one tenant, for the Fleet; it is reported for both
calls.

Run: ``lorasync bench fleet [--engines 1,4,16] [--shape S] [--rank R]`` or ``python -m benchmarks.fleet``
(``--engines`` gives the tenant counts here).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks._engines import CountingEngine
from benchmarks._harness import (
    Case,
    Goal,
    Options,
    Report,
    Table,
    fmt_bytes,
    fmt_ms,
    timeit_many,
)
from benchmarks._shapes import ModelShape
from benchmarks._synth import synth_adapter
from lorasync import Fleet, Publisher
from lorasync.fleet._hash import WORKERS

__all__ = ["run"]

NAME = "fleet"
TENANTS = (1, 4, 16)
LOAD_S = 0.05  # engine-side load time of the counting engine


def run(opts: Options) -> Report:
    shape = ModelShape.load(opts.shapes[0] if opts.shapes else ("qwen3-0.6b" if opts.quick else "qwen3-8b"))
    rank = opts.ranks[0] if opts.ranks else 16
    scope = opts.scope or "all-linear"
    sizes = sorted(set(opts.engines)) or list(TENANTS)
    repeats, warmup = opts.reps(7, 3), opts.warm(1, 1)
    adapters = [synth_adapter(shape, rank=rank, scope=scope, seed=i) for i in range(max(sizes))]
    report = Report(NAME, f"Fleet: a round of N tenants, one changed ({shape.name} r{rank} {scope}, {fmt_bytes(adapters[0].nbytes)} each; engine-side load {LOAD_S * 1e3:.0f} ms)")
    parent = str(opts.root) if opts.root else ("/dev/shm" if Path("/dev/shm").is_dir() else None)
    state: dict[str, Any] = {}
    moved: dict[str, int] = {}

    with tempfile.TemporaryDirectory(prefix="lorasync-bench-fleet-", dir=parent) as tmp:
        root = Path(tmp)
        setups: dict[str, tuple[Any, CountingEngine]] = {}
        for n in sizes:
            engine = CountingEngine(load_delay=LOAD_S)
            fleet = Fleet([engine], transport="disk", root=root / f"fleet{n}")
            for i in range(n):
                fleet.register(f"t{i}", keep=1, grace=0.0)
            fleet.publish({f"t{i}": adapters[i] for i in range(n)}, versions=dict.fromkeys((f"t{i}" for i in range(n)), 0)).raise_for_errors()
            setups[f"fleet:{n}"] = (fleet, engine)
            engine = CountingEngine(load_delay=LOAD_S)
            pubs = [Publisher([engine], name=f"t{i}", transport="disk", root=root / f"pubs{n}", keep=1, grace=0.0) for i in range(n)]
            for i, pub in enumerate(pubs):
                pub.publish(adapters[i], version=0).raise_for_errors()
            setups[f"publishers:{n}"] = (pubs, engine)
        state["version"] = 0

        def step() -> None:  # untimed: tenant 0's trainer steps
            state["version"] += 1
            with torch.no_grad():
                next(iter(adapters[0].tensors.values())).add_(1)

        def round_of(key: str) -> Any:
            what, n = key.split(":")
            target, engine = setups[key.replace("fleet-changed", "fleet")]
            passed = 1 if what == "fleet-changed" else int(n)

            def go() -> None:
                before = engine.counts.file_data
                version = state["version"]
                if what == "publishers":
                    for i, pub in enumerate(target):
                        pub.publish(adapters[i], version=version).raise_for_errors()
                else:  # tenant 0 first: its trainer stepped
                    target.publish({f"t{i}": adapters[i] for i in range(passed)}, versions=dict.fromkeys((f"t{i}" for i in range(passed)), version)).raise_for_errors()
                moved[key] = engine.counts.file_data - before

            return go

        keys = [*setups, *(f"fleet-changed:{n}" for n in sizes if n > 1)]  # the same Fleet, only t0 passed
        cases = {key: Case(round_of(key), setup=step) for key in keys}
        times = timeit_many(cases, repeats=repeats, warmup=warmup, label="fleet (rounds)", show=opts.progress)
        for fleet_or_pubs, _ in setups.values():
            for closing in fleet_or_pubs if isinstance(fleet_or_pubs, list) else [fleet_or_pubs]:
                closing.close()

    first = sizes[0]
    for n in sizes:
        if f"fleet-changed:{n}" not in times:  # one tenant: passing all is passing the changed one
            times[f"fleet-changed:{n}"], moved[f"fleet-changed:{n}"] = times[f"fleet:{n}"], moved[f"fleet:{n}"]
    one = times[f"fleet:{first}"].median
    rows, data = [], {}
    for n in sizes:
        f, c, p = times[f"fleet:{n}"], times[f"fleet-changed:{n}"], times[f"publishers:{n}"]
        data[str(n)] = {
            "fleet": f.to_dict(), "fleet_changed_only": c.to_dict(), "publishers": p.to_dict(),
            "fleet_bytes": moved[f"fleet:{n}"], "fleet_changed_only_bytes": moved[f"fleet-changed:{n}"], "publishers_bytes": moved[f"publishers:{n}"],
        }
        rows.append([n, fmt_ms(f.median), f"{f.median / one:.2f}", fmt_ms(c.median), f"{c.median / one:.2f}", fmt_bytes(moved[f"fleet:{n}"]), fmt_ms(p.median), fmt_bytes(moved[f"publishers:{n}"])])
    report.tables.append(Table(
        f"Round wall time, one tenant changed (median of {repeats} rounds, interleaved; ms; × {first}: over the Fleet's {first}-tenant round; bytes: tensor bytes the engine loaded from files in the last round)",
        ["tenants", "Fleet, all passed", f"× {first}", "Fleet, changed one passed", f"× {first}", "Fleet bytes", "N Publishers ms", "N Publishers bytes"],
        rows,
    ))
    largest = sizes[-1]
    report.goals.append(Goal(f"Fleet: {largest} tenants / {first}, one changed, all {largest} passed", times[f"fleet:{largest}"].median / one, 1.2, f"the {largest - 1} unchanged adapters are hashed (every byte), during the changed one's load"))
    if largest > 1:
        report.goals.append(Goal(f"Fleet: {largest} tenants / {first}, one changed, only it passed", times[f"fleet-changed:{largest}"].median / one, 1.2, "the trainer passes the tenants that stepped"))
    report.notes += [
        (
            "All passed: every round passes all N adapters; only tenant 0's changed. The Fleet hashes the N-1 unchanged ones (xxh3 over every byte, in threads) and publishes one; "
            "with no adapter limit on the engine (this one has none) it starts that publish as soon as tenant 0's hash differs and hashes the rest during its engine load "
            "(with a limit every hash comes first: the slot plan needs every stepping tenant)."
        ),
        "Changed one passed: the same Fleet, passed only tenant 0, as a trainer that passes the tenants that stepped.",
        "N Publishers: each publish of unchanged content writes and hashes its files to learn the hash, then discards them, and re-lists the engine.",
        f"Hashing threads: {WORKERS}; torch intra-op threads: {torch.get_num_threads()}.",
    ]
    report.data = {"shape": shape.name, "rank": rank, "scope": scope, "tenants": sizes, "load_s": LOAD_S, "hash_workers": WORKERS, "timings": data}
    report.plot = lambda fig: _plot(fig, times, sizes)
    return report


def _plot(fig: Any, times: dict[str, Any], sizes: list[int]) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    one = times[f"fleet:{sizes[0]}"].median
    for i, (key, label) in enumerate((("fleet", "Fleet, all passed"), ("fleet-changed", "Fleet, changed one passed"), ("publishers", "N Publishers"))):
        ys = [times[f"{key}:{n}"].median for n in sizes]
        ax1.plot(sizes, [y * 1e3 for y in ys], "o-" if key != "publishers" else "s--", color=f"C{i}", label=label)
        if key != "publishers":
            ax2.plot(sizes, [y / one for y in ys], "o-", color=f"C{i}", label=label)
    ax2.axhline(1.2, color="gray", linestyle="--", label="goal: ≤ 1.2×")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("tenants (one changed)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax1.set_ylabel("round wall time (ms, median)")
    ax1.set_title("Round wall time")
    ax2.set_ylabel(f"× the Fleet's {sizes[0]}-tenant round")
    ax2.set_title("Fleet scaling")


if __name__ == "__main__":  # pragma: no cover
    from benchmarks._runner import main

    raise SystemExit(main(NAME))
