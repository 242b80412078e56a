"""What every benchmark shares: options, repeated timing (median after warm-up), markdown
tables, goals, and the JSON + PNG written under the output directory."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Case", "Goal", "Options", "Report", "Table", "Timing", "fmt_bytes", "fmt_ms", "machine_info", "progress", "ranks_or", "say", "timeit", "timeit_many"]


@dataclass
class Options:
    """Options every benchmark understands (the CLI fills them)."""

    quick: bool = False
    out: Path = Path("bench-out")
    repeats: int | None = None  # None: the benchmark's default (smaller with quick)
    warmup: int | None = None
    shapes: list[str] = field(default_factory=list)  # names or config.json paths; [] = default
    ranks: list[int] = field(default_factory=list)
    scope: str | None = None
    engines: list[int] = field(default_factory=list)  # fan-out sizes
    buckets_mb: list[int] = field(default_factory=list)  # fold bucket sizes
    layers: int | None = None  # layers to synthesise where a full model would not fit
    root: Path | None = None  # tmpfs directory for disk transports (default: /dev/shm)
    progress: bool = True
    inprocess: bool = True  # vllm: the in-process engine's rows (also off with LORASYNC_BENCH_INPROCESS=0)
    plot: bool = True
    against: str | None = None  # regression: the earlier revision (default: run D)

    def reps(self, full: int, quick: int) -> int:
        return self.repeats if self.repeats is not None else (quick if self.quick else full)

    def warm(self, full: int = 1, quick: int = 1) -> int:
        return self.warmup if self.warmup is not None else (quick if self.quick else full)


@dataclass
class Timing:
    """Seconds of each timed repeat (warm-up runs excluded)."""

    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def spread(self) -> tuple[float, float]:
        """Interquartile range (25th, 75th percentile); both ends equal the median for < 4 samples."""
        if len(self.samples) < 4:
            return self.median, self.median
        q = statistics.quantiles(self.samples, n=4)
        return q[0], q[2]

    def to_dict(self) -> dict[str, Any]:
        lo, hi = self.spread
        return {"median_s": self.median, "min_s": self.min, "p25_s": lo, "p75_s": hi, "samples_s": self.samples}


def timeit(
    fn: Callable[[], Any],
    *,
    repeats: int,
    warmup: int = 1,
    setup: Callable[[], Any] | None = None,
    teardown: Callable[[], Any] | None = None,
    label: str = "",
    show: bool = True,
) -> Timing:
    """Run ``fn`` ``warmup`` + ``repeats`` times; only ``fn`` is timed (not setup/teardown)."""
    samples: list[float] = []
    for i in progress(range(warmup + repeats), desc=label, show=show and bool(label)):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if teardown is not None:
            teardown()
        if i >= warmup:
            samples.append(elapsed)
    return Timing(samples)


@dataclass
class Case:
    """One timed function with untimed per-run setup and teardown."""

    fn: Callable[[], Any]
    setup: Callable[[], Any] | None = None
    teardown: Callable[[], Any] | None = None


def timeit_many(cases: dict[str, Case], *, repeats: int, warmup: int = 1, label: str = "", show: bool = True) -> dict[str, Timing]:
    """Time several cases round-robin (case 1, case 2, ..., case 1, ...), so that on a shared
    machine each sees the same background load; ratios between them stay meaningful."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for i in progress(range(warmup + repeats), desc=label, show=show and bool(label)):
        for name, case in cases.items():
            if case.setup is not None:
                case.setup()
            start = time.perf_counter()
            case.fn()
            elapsed = time.perf_counter() - start
            if case.teardown is not None:
                case.teardown()
            if i >= warmup:
                samples[name].append(elapsed)
    return {name: Timing(s) for name, s in samples.items()}


def say(text: str, *, show: bool = True) -> None:
    """One status line on stderr, for the waits no progress bar covers (an engine starting)."""
    if show:
        print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def progress(iterable: Any, *, desc: str = "", show: bool = True, total: int | None = None) -> Any:
    """A tqdm bar on stderr (nothing when disabled or tqdm is missing)."""
    if not show:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, total=total, leave=False, file=sys.stderr, dynamic_ncols=True)


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[Any]]

    def markdown(self) -> str:
        cells = [[str(c) for c in row] for row in self.rows]
        lines = [f"**{self.title}**", "", "| " + " | ".join(self.headers) + " |", "|" + "|".join("---" for _ in self.headers) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(lines)


@dataclass
class Goal:
    """A target from the issue: ``value`` must be ``<= limit``."""

    name: str
    value: float
    limit: float
    detail: str = ""

    @property
    def met(self) -> bool:
        return self.value <= self.limit

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "limit": self.limit, "met": self.met, "detail": self.detail}


@dataclass
class Report:
    """One benchmark's output: tables, goals, notes, raw data and an optional plot."""

    name: str
    title: str
    tables: list[Table] = field(default_factory=list)
    goals: list[Goal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    plot: Callable[[Any], None] | None = None  # draws into a matplotlib Figure
    skipped: str | None = None
    files: list[Path] = field(default_factory=list)

    def markdown(self) -> str:
        parts = [f"### {self.title}"]
        if self.skipped:
            parts.append(f"_Skipped: {self.skipped}_")
        parts += [t.markdown() for t in self.tables]
        if self.goals:
            rows = [[g.name, f"{g.value:.3g}", f"≤ {g.limit:g}", "met" if g.met else "**missed**", g.detail] for g in self.goals]
            parts.append(Table("Goals", ["goal", "measured", "target", "", "note"], rows).markdown())
        if self.notes:
            parts.append("\n".join(f"- {n}" for n in self.notes))
        return "\n\n".join(parts)

    def write(self, out: Path, *, plot: bool = True) -> list[Path]:
        """Write ``<out>/<name>.json`` (and ``<name>.png``, ``<name>.md``); return the paths."""
        out.mkdir(parents=True, exist_ok=True)
        payload = {
            "benchmark": self.name,
            "title": self.title,
            "skipped": self.skipped,
            "machine": machine_info(),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "tables": [{"title": t.title, "headers": t.headers, "rows": t.rows} for t in self.tables],
            "goals": [g.to_dict() for g in self.goals],
            "notes": self.notes,
            "data": self.data,
        }
        files = [out / f"{self.name}.json", out / f"{self.name}.md"]
        files[0].write_text(json.dumps(payload, indent=2, default=str) + "\n")
        files[1].write_text(self.markdown() + "\n")
        if plot and self.plot is not None and not self.skipped:
            import matplotlib

            matplotlib.use("Agg")
            from matplotlib.figure import Figure

            fig = Figure(figsize=(11, 4.8), layout="constrained")
            self.plot(fig)
            png = out / f"{self.name}.png"
            fig.savefig(png, dpi=110)
            files.append(png)
        self.files = files
        return files


def machine_info() -> dict[str, Any]:
    """CPU, memory, versions and load: enough to judge whether two runs compare."""
    import torch

    import lorasync

    info: dict[str, Any] = {
        "when": _dt.datetime.now().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lorasync": lorasync.__version__,
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
        with open("/proc/meminfo") as f:
            info["mem_total_kb"] = int(f.readline().split()[1])
    except OSError:
        pass
    try:
        root = Path(lorasync.__file__).resolve().parent.parent
        info["git"] = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["git"] = None
    return info


def fmt_bytes(n: float) -> str:
    """Decimal units, as disks and networks count: ``87.3 MB``."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def ranks_or(opts: Options, default: Sequence[int]) -> list[int]:
    return list(opts.ranks) or list(default)
