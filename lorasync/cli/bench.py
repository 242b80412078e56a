"""``lorasync bench [NAME ...]``: measure lorasync on your own model shapes.

Benchmarks: ``bytes`` (adapter vs merged payload), ``publish`` (disk publish and IPC handoff vs
raw-write, PEFT-save and memcpy floors), ``vllm`` (trainer weights → first completion on a real
vLLM: lorasync vs PEFT save_pretrained + load, the benchmark of record; ``--shape qwen3-0.6b``
adds a Qwen3-0.6B-shaped model),
``fanout`` (1–8 engines), ``fold`` (merged-fold peak memory vs bucket size), ``fleet`` (a round
of 1, 4, 16 tenants with one changed, against as many Publishers; ``--engines`` gives the tenants),
``replicas`` (publish → every replica serving for 1, 2, 4 real vLLM servers behind vllm-router,
against a load per replica by hand; ``--engines`` gives the replica counts; run only when named).
Without NAME all but ``replicas`` and ``regression`` run. Each prints a markdown table and writes ``NAME.json``, ``NAME.md`` and ``NAME.png`` under
``--out`` (the PNG only with matplotlib: ``pip install 'lorasync[bench]'``). The suite is the
``benchmarks`` package, shipped in the wheel and next to ``lorasync/`` in a checkout. The vLLM
benchmark finds the engine venv through ``LORASYNC_VLLM_PYTHON`` or ``LORASYNC_ENGINE_CACHE``; when
that venv is missing or half-built (no ready marker: scripts/engine-venv.sh was interrupted) it is
skipped with the command to run, and the other benchmarks still run (exit code 0). While its
vLLM servers start (about a minute each on a small CPU box) it says so on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from lorasync.cli._common import plain
from lorasync.errors import ConfigError

__all__ = ["BENCHMARKS", "add_arguments", "register"]

BENCHMARKS = ("bytes", "publish", "vllm", "fanout", "fold", "fleet", "replicas", "regression")
#: what a bare ``lorasync bench`` runs; ``replicas`` starts four vLLM servers (asked for by name),
#: ``regression`` compares with git history (a checkout only)
DEFAULT = tuple(b for b in BENCHMARKS if b not in ("replicas", "regression"))


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="run the benchmark suite (bytes, publish, vllm, fanout, fold, fleet; replicas and regression by name)", description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=_main)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench options (shared by ``lorasync bench`` and ``python -m benchmarks``)."""
    p.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run: {', '.join(BENCHMARKS)} (default: all but replicas and regression)")
    p.add_argument("--quick", action="store_true", help="reduced sizes and repeats (all benchmarks in a few minutes)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), metavar="DIR", help="where JSON, markdown and PNG files go (default ./bench-out)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME_OR_CONFIG", help="model shape: a shipped name (qwen3-8b, llama-3.1-70b, ...), a config.json or a model directory (repeatable)")
    p.add_argument("--rank", action="append", default=[], type=_ints, metavar="R[,R...]", help="LoRA ranks (repeatable or comma-separated)")
    p.add_argument("--scope", metavar="SCOPE", help="'all-linear', 'attention' or leaf names like q_proj,v_proj")
    p.add_argument("--engines", action="append", default=[], type=_ints, metavar="N[,N...]", help="fan-out sizes (default 1,2,4,8), fleet tenants, replicas' replica counts (default 1,2,4)")
    p.add_argument("--bucket-mb", action="append", default=[], type=_ints, metavar="MB[,MB...]", help="merged-fold bucket sizes in MB")
    p.add_argument("--layers", type=int, metavar="N", help="layers of synthetic base weights for the fold benchmark")
    p.add_argument("--repeats", type=int, metavar="N", help="timed repeats per measurement (median reported)")
    p.add_argument("--warmup", type=int, metavar="N", help="untimed warm-up runs per measurement")
    p.add_argument("--root", type=Path, metavar="DIR", help="directory on tmpfs for disk transports (default /dev/shm)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-plot", action="store_true", help="write no PNG files")
    p.add_argument("--no-inprocess", action="store_true", help="bench vllm: skip the in-process vllm.LLM rows (they add about a minute, mostly its start-up)")
    p.add_argument("--against", metavar="REV", help="bench regression: the earlier git revision to compare with (default 09898ca, the benchmark of record in docs/benchmarks.md)")


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 8 or 8,16,32, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _import_suite() -> Any:
    """``benchmarks._runner``; the suite sits next to the ``lorasync`` package in a checkout."""
    try:
        return importlib.import_module("benchmarks._runner")
    except ModuleNotFoundError as exc:
        if exc.name not in ("benchmarks", "benchmarks._runner"):
            raise
    import lorasync

    checkout = Path(lorasync.__file__).resolve().parent.parent
    if not (checkout / "benchmarks" / "_runner.py").is_file():
        raise ConfigError("the benchmark suite is missing from this install; pip install 'lorasync[bench]' (the wheel ships it) or run from a checkout")
    sys.path.insert(0, str(checkout))
    return importlib.import_module("benchmarks._runner")


def _main(args: argparse.Namespace) -> int:
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        raise ConfigError(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    runner = _import_suite()
    plot = not args.no_plot
    if plot and importlib.util.find_spec("matplotlib") is None:
        # JSON and markdown need nothing extra; only the PNG plots need matplotlib.
        print("matplotlib is not installed: writing JSON and markdown only; for PNG plots: pip install 'lorasync[bench]'", file=sys.stderr)
        plot = False
    opts = runner.Options(
        quick=args.quick,
        out=args.out,
        repeats=args.repeats,
        warmup=args.warmup,
        shapes=list(args.shape),
        ranks=[r for group in args.rank for r in group],
        scope=args.scope,
        engines=[n for group in args.engines for n in group],
        buckets_mb=[n for group in args.bucket_mb for n in group],
        layers=args.layers,
        root=args.root,
        progress=not args.no_progress,
        plot=plot,
        inprocess=not args.no_inprocess,
        against=args.against,
    )
    return int(runner.run_all(list(args.names) or list(DEFAULT), opts))
