"""Bytes per sync: a LoRA adapter vs the merged fallback, for real model shapes.

Computed from the model geometry for every shape, rank, scope and adapter dtype; for one small
model also *measured* through lorasync's own transports (files the disk transport writes, the
shared-memory segment of an IPC load, merged buckets pushed) with a counting engine. Computed
and measured tensor bytes must be equal; the benchmark fails if they are not.

Run: ``lorasync bench bytes [--shape NAME_OR_CONFIG] [--rank R ...]`` or ``python -m benchmarks.bytes``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks._engines import CountingEngine
from benchmarks._harness import Goal, Options, Report, Table, fmt_bytes, progress
from benchmarks._shapes import SCOPES, ModelShape
from benchmarks._synth import synth_adapter, synth_base_tensors
from lorasync import BaseWeights, Publisher

__all__ = ["measure_bytes", "run"]

NAME = "bytes"
RANKS = (1, 2, 4, 8, 16, 32, 64, 128)
QUICK_RANKS = (1, 16, 128)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_SHAPES = ("qwen3-0.6b", "qwen3-8b", "llama-3.1-8b", "qwen2.5-32b", "llama-3.1-70b", "qwen3-30b-a3b")


def measure_bytes(shape: ModelShape, *, rank: int, scope: str, dtype: torch.dtype, root: str | Path, layers: list[int] | None = None) -> dict[str, Any]:
    """Publish one synthetic adapter through the disk, IPC and merged transports to counting
    engines and compare what moved with :meth:`ModelShape.adapter_bytes` / ``merged_bytes``.

    Returns:
        ``{"computed": {...}, "measured": {...}}`` in bytes.

    Raises:
        AssertionError: computed and measured tensor bytes differ.
    """
    adapter = synth_adapter(shape, rank=rank, scope=scope, dtype=dtype, layers=layers)
    computed = {"adapter": shape.adapter_bytes(rank, scope, dtype, layers=layers), "merged": shape.merged_bytes(scope, layers=layers)}
    measured: dict[str, int] = {"adapter_nbytes": adapter.nbytes}
    base = BaseWeights.from_tensors(synth_base_tensors(shape, scope=scope, layers=layers))
    for transport in ("disk", "ipc", "merged"):
        engine = CountingEngine()
        with Publisher([engine], name="bytes", transport=transport, root=root, base=base if transport == "merged" else None) as pub:
            report = pub.publish(adapter, version=1)
        report.raise_for_errors()
        c = engine.counts
        if transport == "disk":
            measured.update(disk_files=c.files, disk_data=c.file_data, disk_reported=report.bytes_moved)
        elif transport == "ipc":
            measured.update(shm_segment=c.shm, shm_data=c.shm_data, ipc_reported=report.bytes_moved)
        else:
            measured.update(merged_pushed=c.weights, merged_reported=report.bytes_moved, merged_buckets=c.buckets)
    checks = {
        "adapter.nbytes": (measured["adapter_nbytes"], computed["adapter"]),
        "disk safetensors data": (measured["disk_data"], computed["adapter"]),
        "shared-memory data": (measured["shm_data"], computed["adapter"]),
        "ipc reported": (measured["ipc_reported"], computed["adapter"]),
        "disk reported (all files)": (measured["disk_reported"], measured["disk_files"]),
        "merged pushed": (measured["merged_pushed"], computed["merged"]),
        "merged reported": (measured["merged_reported"], computed["merged"]),
    }
    wrong = {k: v for k, v in checks.items() if v[0] != v[1]}
    if wrong:
        raise AssertionError(f"{shape.name} r{rank} {scope} {dtype}: measured != computed bytes for " + ", ".join(f"{k}: {m} vs {c}" for k, (m, c) in wrong.items()))
    return {"computed": computed, "measured": measured}


def run(opts: Options) -> Report:
    shapes = [ModelShape.load(s) for s in (opts.shapes or DEFAULT_SHAPES)]
    ranks = list(opts.ranks) or list(QUICK_RANKS if opts.quick else RANKS)
    scopes = [opts.scope] if opts.scope else list(SCOPES)
    report = Report(NAME, "Sync payload: adapter vs merged fallback (bytes per publish)")

    computed: list[dict[str, Any]] = []
    rows = []
    for shape in shapes:
        for rank in ranks:
            entry: dict[str, Any] = {"shape": shape.name, "rank": rank}
            row: list[Any] = [shape.name, rank]
            for scope in scopes:
                for dname, dtype in DTYPES.items():
                    n = shape.adapter_bytes(rank, scope, dtype)
                    entry[f"adapter_{scope}_{dname}"] = n
                    row.append(fmt_bytes(n))
            computed.append(entry)
            rows.append(row)
    report.tables.append(Table("Adapter bytes (tensor data) per publish", ["model", "rank", *[f"{s} {d}" for s in scopes for d in DTYPES]], rows))

    merged_rows = []
    merged: list[dict[str, Any]] = []
    ref_rank = 16 if 16 in ranks else ranks[len(ranks) // 2]
    for shape in shapes:
        total = shape.model_bytes()
        entry = {"shape": shape.name, "model_bytes": total, "dtype": str(shape.dtype).removeprefix("torch.")}
        row: list[Any] = [shape.name, fmt_bytes(total)]
        for scope in scopes:
            n = shape.merged_bytes(scope)
            entry[f"merged_{scope}"] = n
            ratio = n / shape.adapter_bytes(ref_rank, scope, torch.bfloat16)
            entry[f"merged_over_adapter_r{ref_rank}_{scope}"] = ratio
            row += [f"{fmt_bytes(n)} ({100 * n / total:.0f}%)", f"{ratio:,.0f}×"]
        merged.append(entry)
        merged_rows.append(row)
    headers = ["model", "whole model"]
    for scope in scopes:
        headers += [f"merged {scope} (% of model)", f"merged / r{ref_rank} bf16 adapter"]
    report.tables.append(Table("Merged fallback: bytes pushed per publish (touched modules only, base dtype, vLLM's fused q/k/v and gate/up groups whole)", headers, merged_rows))

    # Measured through the transports, for one small model.
    small = ModelShape.load("tiny" if opts.quick else "qwen3-0.6b")
    m_ranks = [ref_rank] if opts.quick else sorted({ranks[0], ref_rank, ranks[-1]})
    measured_rows = []
    measurements = []
    with tempfile.TemporaryDirectory(prefix="lorasync-bench-bytes-", dir=_tmpfs(opts)) as root:
        jobs = [(r, s, d) for r in m_ranks for s in scopes for d in DTYPES]
        for rank, scope, dname in progress(jobs, desc=f"measure {small.name}", show=opts.progress):
            result = measure_bytes(small, rank=rank, scope=scope, dtype=DTYPES[dname], root=Path(root) / f"r{rank}-{scope}-{dname}")
            c, m = result["computed"], result["measured"]
            measurements.append({"shape": small.name, "rank": rank, "scope": scope, "dtype": dname, **result})
            measured_rows.append([
                small.name, rank, scope, dname, c["adapter"], m["disk_data"], m["disk_files"] - m["disk_data"], m["shm_data"], m["shm_segment"] - m["shm_data"], c["merged"], m["merged_pushed"],
            ])
    report.tables.append(Table(
        f"Computed vs measured on {small.name} (bytes; measured through Publisher → disk / ipc / merged transports)",
        ["model", "rank", "scope", "dtype", "computed adapter", "disk: safetensors data", "disk: headers+config", "shm: data", "shm: header", "computed merged", "merged: pushed"],
        measured_rows,
    ))
    report.notes.append("Every measured tensor-byte count equals the computed one (checked; the benchmark fails otherwise). Header/config overhead is listed separately.")
    report.notes.append("MoE (Qwen3-30B-A3B): all-linear = attention + every expert's gate/up/down (vLLM's per-expert LoRA layout); the router is never a target.")
    report.goals.append(Goal("measured - computed bytes (all transports)", 0, 0, f"{len(measurements)} configurations on {small.name}"))
    report.data = {"computed": computed, "merged": merged, "measured": measurements, "ranks": ranks, "scopes": scopes}
    report.plot = lambda fig: _plot(fig, computed, merged, scopes, ranks)
    return report


def _tmpfs(opts: Options) -> str | None:
    if opts.root is not None:
        opts.root.mkdir(parents=True, exist_ok=True)
        return str(opts.root)
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


def _plot(fig: Any, computed: list[dict[str, Any]], merged: list[dict[str, Any]], scopes: list[str], ranks: list[int]) -> None:
    axes = fig.subplots(1, len(scopes), sharey=True, squeeze=False)[0]
    colors = {}
    for ax, scope in zip(axes, scopes, strict=True):
        for i, m in enumerate(merged):
            name = m["shape"]
            color = colors.setdefault(name, f"C{i}")
            pts = [(e["rank"], e[f"adapter_{scope}_bf16"]) for e in computed if e["shape"] == name]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=f"{name} adapter (bf16)")
            ax.axhline(m[f"merged_{scope}"], color=color, linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ranks, [str(r) for r in ranks])
        ax.set_xlabel("LoRA rank")
        ax.set_title(f"{scope}: adapter (solid) vs merged fallback (dashed)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("bytes per publish")
    axes[-1].legend(fontsize=7, loc="lower right")


if __name__ == "__main__":  # pragma: no cover
    from benchmarks._runner import main

    raise SystemExit(main(NAME))
