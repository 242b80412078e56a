"""How lorasync's names pass through AIBrix: its runtime sidecar takes only ``[A-Za-z0-9_-]``, at
most 100 characters (``aibrix.openapi.engine.vllm._validate_lora_request``, aibrix 0.8.0), and
lorasync serves ``name@vN``. :func:`request_name` spells each version in that alphabet, injectively
(``_`` written ``__``, ``.`` written ``_d``, then ``_vN``), and :func:`served_from_request` reads a
name vLLM lists back. Used by :mod:`lorasync.engines.aibrix`.
"""

from __future__ import annotations

import re

from lorasync.adapter._names import parse_served_name, served_name
from lorasync.errors import InvalidNameError

__all__ = ["MAX_REQUEST_NAME", "UNMANAGED_MARK", "request_name", "served_from_request"]

MAX_REQUEST_NAME = 100  # aibrix.openapi.engine.vllm._validate_lora_request
_ALPHABET = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {"_": "__", ".": "_d"}
_UNESCAPES = {"_": "_", "d": "."}
# A name vLLM lists that lorasync would read as its own but that AIBrix cannot have loaded (it
# refuses '@'): loaded around the sidecar. Listed with this mark so it stays foreign.
UNMANAGED_MARK = "#loaded-around-aibrix"


def request_name(name: str) -> str:
    """The name AIBrix and vLLM serve ``name`` under: lorasync's ``name@vN`` spelled in AIBrix's
    alphabet (``policy@v3`` → ``policy_v3``, ``my_run.a@v12`` → ``my__run_da_v12``); any other
    name as it is, if AIBrix takes it.

    Raises:
        InvalidNameError: the name cannot pass AIBrix's rule (``[A-Za-z0-9_-]``, at most 100
            characters), or a plain name reads as another name's spelling.
    """
    parsed = parse_served_name(name)
    if parsed is not None:
        base, version = parsed
        wire = "".join(_ESCAPES.get(c, c) for c in base) + f"_v{version}"
    else:
        if not isinstance(name, str) or not _ALPHABET.fullmatch(name):
            raise InvalidNameError(
                f"adapter name {name!r} cannot pass through AIBrix (a load or an unload), whose sidecar takes only letters, digits, '-' and '_'"
            )
        if served_from_request(name) != name:
            raise InvalidNameError(
                f"adapter name {name!r} is how lorasync spells {served_from_request(name)!r} for AIBrix; choose another name"
            )
        wire = name
    if len(wire) > MAX_REQUEST_NAME:
        raise InvalidNameError(
            f"adapter name {name!r} is {len(wire)} characters as AIBrix serves it ({wire[:40]}...); AIBrix takes at most "
            f"{MAX_REQUEST_NAME}: use a shorter publisher name"
        )
    return wire


def served_from_request(wire: str) -> str:
    """The inverse of :func:`request_name` for a name vLLM lists: lorasync's ``name@vN`` where
    ``wire`` is its spelling, else ``wire`` itself (a name lorasync reads as its own but AIBrix
    cannot have loaded comes back marked, so it stays foreign)."""
    if not isinstance(wire, str):  # engines may list odd values: foreign, as they are
        return wire
    decoded = _decode(wire)
    if decoded is not None:
        return decoded
    if parse_served_name(wire) is not None:
        return wire + UNMANAGED_MARK
    return wire


def _decode(wire: str) -> str | None:
    out: list[str] = []
    i = 0
    while i < len(wire):
        c = wire[i]
        if c != "_":
            out.append(c)
            i += 1
            continue
        nxt = wire[i + 1 : i + 2]
        if nxt == "v":
            digits = wire[i + 2 :]
            # At most 15 digits (validate_version's bound): also keeps int() off Python's digit limit.
            if not digits.isascii() or not digits.isdigit() or len(digits) > 15 or str(int(digits)) != digits:
                return None
            try:
                served = served_name("".join(out), int(digits))
            except InvalidNameError:
                return None
            return served if parse_served_name(served) is not None else None
        if nxt not in _UNESCAPES:
            return None
        out.append(_UNESCAPES[nxt])
        i += 2
    return None
