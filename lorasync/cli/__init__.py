"""The ``lorasync`` command line: demo, export, publish, inspect, bench.

Each subcommand lives in its own module exposing ``register(subparsers)``; the parser sets
``func`` to the handler, which returns the exit code (see :mod:`lorasync.cli._common`). Nothing
here imports torch or httpx: ``lorasync --help`` and ``--version`` answer without them.

May import: every package (the top floor); nothing imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys

from lorasync.cli._common import BAD_INPUT, BROKEN_PIPE, EPILOG, Parser, add_common, emit, error_payload, exit_code_for, setup_logging

__all__ = ["main"]

SUBCOMMANDS = ("demo", "export", "publish", "inspect", "bench")


def build_parser() -> argparse.ArgumentParser:
    from lorasync import __version__

    parser = Parser(
        prog="lorasync",
        description="Push freshly trained LoRA adapters from trainers into running inference engines.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"lorasync {__version__}")
    add_common(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in SUBCOMMANDS:
        importlib.import_module(f"lorasync.cli.{name}").register(sub)
    _add_common_everywhere(sub)
    return parser


def _add_common_everywhere(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """--json/-q/-v on every subcommand, nested ones (``export megatron``) included."""
    for choice in sub.choices.values():
        add_common(choice)
        choice.epilog = choice.epilog or EPILOG
        for action in choice._actions:
            if isinstance(action, argparse._SubParsersAction):
                _add_common_everywhere(action)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    from lorasync.cli import _common

    argv = sys.argv[1:] if argv is None else list(argv)
    Parser.json_requested = "--json" in argv
    _common.json_stream = sys.stdout
    try:
        try:
            return _main(argv)
        finally:  # also on argparse's SystemExit (--help): here, not at exit, so it is caught below
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`lorasync --json inspect DIR | head -1`): stop quietly, as a
        # program a closed pipe stops. stdout goes to devnull so the interpreter's own final
        # flush cannot raise again and print a traceback.
        _silence_stdout()
        return BROKEN_PIPE
    finally:
        _common.json_stream = None


def _silence_stdout() -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real file (a test's capture): nothing to flush
        pass


def _main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args)
    if not getattr(args, "func", None):
        parser.print_help()
        return BAD_INPUT
    from lorasync.errors import LoraSyncError

    try:
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            return int(args.func(args) or 0)
    except LoraSyncError as exc:
        code = exit_code_for(exc)
        if args.json:
            emit(error_payload(exc, code), as_json=True)
        else:
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
