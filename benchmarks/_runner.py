"""Run benchmarks by name, print their tables, write their files."""

from __future__ import annotations

import importlib
import sys
import time
import traceback

from benchmarks._harness import Options, Report

__all__ = ["MODULES", "Options", "main", "run_all", "run_one"]

MODULES = {
    "bytes": "benchmarks.bytes",
    "publish": "benchmarks.publish",
    "vllm": "benchmarks.vllm_latency",
    "fanout": "benchmarks.fanout",
    "fold": "benchmarks.fold_memory",
    "fleet": "benchmarks.fleet",
    "replicas": "benchmarks.replicas",
    "regression": "benchmarks.regression",
}


def run_one(name: str, opts: Options) -> Report:
    """Run benchmark ``name`` and write its files under ``opts.out``."""
    report: Report = importlib.import_module(MODULES[name]).run(opts)
    report.write(opts.out, plot=opts.plot)
    return report


def run_all(names: list[str], opts: Options) -> int:
    """Run ``names`` in order; print each table as it completes. Returns the exit code: 1 if a
    benchmark failed (raised), else 0 (missed goals are reported, not failures)."""
    failed = []
    for name in names:
        start = time.perf_counter()
        print(f"\n## bench {name}{' (quick)' if opts.quick else ''}\n", flush=True)
        try:
            report = run_one(name, opts)
        except Exception:
            traceback.print_exc()
            failed.append(name)
            continue
        print(report.markdown())
        print(f"\n_{time.perf_counter() - start:.1f} s; files: {', '.join(str(p) for p in report.files)}_", flush=True)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def main(name: str | None = None, argv: list[str] | None = None) -> int:
    """``python -m benchmarks[.NAME] [options]``: the same options as ``lorasync bench``."""
    from lorasync.cli import main as cli_main

    args = list(sys.argv[1:] if argv is None else argv)
    return cli_main(["bench", *([name] if name else []), *args])
