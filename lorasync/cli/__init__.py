"""The ``lorasync`` command line: demo, export, publish, inspect, bench.

Each subcommand lives in its own module exposing ``register(subparsers)``; the parser sets
``func`` to the handler, which returns the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from lorasync.errors import LoraSyncError

__all__ = ["main"]

SUBCOMMANDS = ("demo", "export", "publish", "inspect", "bench")


def build_parser() -> argparse.ArgumentParser:
    from lorasync import __version__

    parser = argparse.ArgumentParser(
        prog="lorasync",
        description="Push freshly trained LoRA adapters from trainers into running inference engines.",
    )
    parser.add_argument("--version", action="version", version=f"lorasync {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (INFO level)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"lorasync.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except LoraSyncError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
