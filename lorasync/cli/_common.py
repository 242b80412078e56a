"""What every ``lorasync`` subcommand shares: exit codes, ``--json``/``-q``/``-v``, logging.

Exit codes (documented in ``lorasync --help``):

* 0 success; 1 a check that ran and said no (``inspect`` found an engine that refuses);
* 2 bad input (options, paths, a folder that holds no adapter, adapter content, unknown engine
  kind, a stale version: on every engine it failed, the input was what it refused);
* 3 an engine failure (unreachable, refused, did not reproduce the probe);
* 4 a partial publish (some engines serve the new version, others do not);
* 141 the reader of the output went away (``lorasync --json inspect DIR | head -1``), as for any
  program a closed pipe stops.

Kept free of torch/httpx imports: ``--help``, ``--version`` and every mistake in the arguments,
paths or engine specs answer in well under a second (tests/cli/test_cli_speed.py times it).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
from typing import Any

__all__ = [
    "BAD_INPUT",
    "BROKEN_PIPE",
    "ENGINE_FAILURE",
    "EPILOG",
    "OK",
    "PARTIAL",
    "TRANSPORT_HELP",
    "REFUSED",
    "Parser",
    "add_common",
    "emit",
    "error_payload",
    "exit_code_for",
    "plain",
    "publish_exit_code",
    "setup_logging",
    "validate_engine_specs",
]

OK, REFUSED, BAD_INPUT, ENGINE_FAILURE, PARTIAL, BROKEN_PIPE = 0, 1, 2, 3, 4, 141

EPILOG = (
    "exit codes: 0 ok; 1 a check said no (inspect: an engine would refuse the adapter); "
    "2 bad input (options, paths, a folder with no adapter, unknown engine kind, a stale version); "
    "3 engine failure (unreachable, refused, did not reproduce the probe); "
    "4 partial publish (some engines updated, others not); 141 the output's reader went away. "
    "--json prints one JSON document, errors included."
)

TRANSPORT_HELP = (
    "how the adapter reaches each engine: auto (default: per engine, from what it can do), disk (files on this "
    "host's tmpfs), ipc (shared memory; vLLM needs its worker extension and dev mode), merged (base weights + "
    "LoRA folded in; needs --base and, on vLLM, the worker extension and dev mode)"
)


def plain(doc: str | None) -> str | None:
    """``doc`` (a module docstring) as help text for people: reST markup dropped.

    ````lorasync demo```` becomes ``lorasync demo``, ``:class:`~lorasync.errors.ConfigError```
    becomes ``ConfigError`` and ``:func:`run_demo``` becomes ``run_demo``.
    """
    if doc is None:
        return None
    doc = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0) else m.group(1), doc)
    return doc.replace("``", "")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors honour ``--json`` (exit code 2 either way)."""

    json_requested = False  # set by main() from its argv before parsing

    def error(self, message: str) -> Any:  # argparse's hook; never returns
        if Parser.json_requested:
            emit({"ok": False, "exit_code": BAD_INPUT, "error": {"type": "UsageError", "message": message}}, as_json=True)
            sys.exit(BAD_INPUT)
        super().error(message)


def add_common(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``--json``, ``-q`` and ``-v`` on the main parser and again on every subcommand.

    On subcommands the defaults are suppressed, so ``lorasync --json inspect X`` and
    ``lorasync inspect X --json`` mean the same.
    """
    default: Any = argparse.SUPPRESS if not top else None
    parser.add_argument("--json", action="store_true", default=False if top else argparse.SUPPRESS, help="print one JSON document (errors included)")
    parser.add_argument("-q", "--quiet", action="store_true", default=False if top else argparse.SUPPRESS, help="only errors")
    parser.add_argument("-v", "--verbose", action="count", default=0 if top else default, help="log what happens: -v INFO, -vv DEBUG")


def setup_logging(args: argparse.Namespace) -> None:
    level = logging.ERROR if args.quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose or 0, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("lorasync").setLevel(level)
    if level > logging.DEBUG:  # foreign libraries' INFO chatter (httpx request lines) stays out
        for noisy in ("httpx", "httpcore", "urllib3"):
            logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


def exit_code_for(exc: BaseException) -> int:
    """The exit code of a lorasync error: 2 bad input, 3 engine failure, 1 otherwise."""
    from lorasync import errors

    if isinstance(exc, (errors.EngineError, errors.TransportError, errors.VerificationError)) and not isinstance(exc, errors.StorageError):
        return ENGINE_FAILURE
    if isinstance(exc, (ValueError, errors.RegistryError, errors.StaleVersionError, errors.StorageError, FileNotFoundError)):
        return BAD_INPUT
    if isinstance(exc, errors.PublishError):
        return ENGINE_FAILURE
    return REFUSED


def publish_exit_code(reports: list[Any]) -> int:
    """0 when every engine of every report serves its version, 4 when some do; when none do, 2
    if every engine refused the input itself (a stale version: the fix is the command line, not
    the engine), else 3."""
    results = [r for report in reports for r in report.results]
    if results and all(r.ok for r in results):
        return OK
    if any(r.ok for r in results):
        return PARTIAL
    errors = [r.error for r in results]
    if errors and all(e is not None and exit_code_for(e) == BAD_INPUT for e in errors):
        return BAD_INPUT
    return ENGINE_FAILURE


def error_payload(exc: BaseException, code: int) -> dict[str, Any]:
    return {"ok": False, "exit_code": code, "error": {"type": type(exc).__name__, "message": str(exc)}}


# Where the one JSON document goes. With --json, main() points sys.stdout at stderr while the
# command runs, so a library that prints (DeepSpeed's accelerator banner, progress bars) cannot
# corrupt the document.
json_stream: Any = None


def emit(payload: Any, *, as_json: bool, text: str | None = None, quiet: bool = False) -> None:
    """Print ``payload`` as strict JSON, or ``text`` for people (nothing with ``-q``).

    NaN and infinities (a config's ``lora_alpha: NaN``) are written as the strings ``"NaN"``,
    ``"Infinity"`` and ``"-Infinity"``: Python's bare ``NaN`` is no JSON, and strict parsers
    (``jq``, JavaScript, Go) refuse the whole document.
    """
    if as_json:
        print(json.dumps(_finite(payload), indent=2, default=str, allow_nan=False), file=json_stream or sys.stdout, flush=True)
    elif text is not None and not quiet:
        print(text)


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by its JSON-ish name (containers copied)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {_finite(k) if isinstance(k, float) else k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def validate_engine_specs(specs: list[str]) -> list[str]:
    """Check ``ENGINE:URL`` specs by their form, before anything slow happens.

    Returns:
        `list[str]`: the specs, unchanged.

    Raises:
        ConfigError: a spec without an engine kind (``http://host``), with ``://`` after the
            kind (``vllm://host``), or a remote engine without an http(s) URL.
        UnknownEngineError: a kind that no built-in or installed plugin registers.
    """
    from lorasync.errors import ConfigError

    form = "ENGINE:URL, e.g. vllm:http://127.0.0.1:8000 or sglang:http://127.0.0.1:30000 (peft needs no URL)"
    for spec in specs:
        kind, sep, url = spec.partition(":")
        if kind in ("http", "https"):
            raise ConfigError(f"engine spec {spec!r} has no engine kind; write {form}")
        if url.startswith("//"):
            raise ConfigError(f"engine spec {spec!r} is not ENGINE:URL; write {kind}:http:{url} ({form})")
        if not kind or not kind.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"engine spec {spec!r} is not {form}")
        if kind != "peft" and not url.startswith(("http://", "https://")):
            raise ConfigError(f"engine spec {spec!r} needs an http(s) URL; write {form}")
    _check_kinds([spec.partition(":")[0] for spec in specs])
    return list(specs)


def _check_kinds(kinds: list[str]) -> None:
    """Refuse an engine kind nothing registers, by name only: the registry's table and the
    ``lorasync.engines`` entry points are read, no engine module is imported (a misspelled
    ``vlm:`` must not wait for torch).

    Raises:
        UnknownEngineError: a kind no built-in or plugin registers (the message lists them).
    """
    import difflib

    from lorasync.engines._registry import engine_registry
    from lorasync.errors import UnknownEngineError

    known = sorted(engine_registry.available())
    for kind in kinds:
        if kind not in known:
            close = difflib.get_close_matches(kind, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UnknownEngineError(
                f"no engine kind {kind!r}; {hint}available: {', '.join(known)} (a plugin's kind appears once "
                "the package that provides it is installed: it registers under the 'lorasync.engines' entry-point group)",
                name=kind,
            )
