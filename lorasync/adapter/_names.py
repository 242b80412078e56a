"""Validation of adapter names and versions before they become paths, engine ids or URLs.

Names are ASCII ``[A-Za-z0-9][A-Za-z0-9._-]*`` (at most 96 characters, no ``..``): no
separators, no NUL, no traversal, no unicode look-alikes. Versions are non-negative integers;
the served name of version N is ``<name>@v<N>``.
"""

from __future__ import annotations

import re

from lorasync.errors import InvalidNameError

__all__ = ["MAX_NAME", "parse_served_name", "served_name", "validate_name", "validate_version"]

MAX_NAME = 96
MAX_VERSION = 10**15
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# Exactly what served_name() writes: no leading zeros, at most 15 digits (MAX_VERSION = 10**15).
_SERVED = re.compile(r"(?P<name>.+)@v(?P<version>0|[1-9][0-9]{0,14})")


def validate_name(name: object) -> str:
    """Return ``name`` if it is safe as a directory name and engine id.

    Raises:
        InvalidNameError: anything else, with the rule it broke.
    """
    if not isinstance(name, str):
        raise InvalidNameError(f"adapter name must be a str, got {type(name).__name__}")
    shown = repr(name[:40]) + ("..." if len(name) > 40 else "")
    if not name or len(name) > MAX_NAME:
        raise InvalidNameError(f"adapter name {shown} must be 1-{MAX_NAME} characters long")
    if not _NAME.fullmatch(name) or ".." in name:
        raise InvalidNameError(
            f"adapter name {shown} may use only ASCII letters, digits, '.', '_' and '-', must start "
            "with a letter or digit and must not contain '..' (it becomes a directory name)"
        )
    return name


def validate_version(version: object) -> int:
    """Return ``version`` as an int if it is a non-negative integer (or a string of digits).

    Raises:
        InvalidNameError: negative, non-integer, huge or non-digit versions.
    """
    if isinstance(version, bool):
        raise InvalidNameError("version must be an integer, not a bool")
    if isinstance(version, str):
        if not version.isascii() or not version.isdigit() or len(version) > 15:
            raise InvalidNameError(f"version {version[:40]!r} must be a non-negative integer such as 3 (a trainer step)")
        version = int(version)
    if not isinstance(version, int) or version < 0 or version >= MAX_VERSION:
        raise InvalidNameError(f"version {version!r} must be an integer in [0, {MAX_VERSION})")
    return version


def served_name(name: str, version: int) -> str:
    """The name engines serve version ``version`` of ``name`` under: ``name@vN``."""
    return f"{validate_name(name)}@v{validate_version(version)}"


def parse_served_name(served: object) -> tuple[str, int] | None:
    """``"policy@v3"`` → ``("policy", 3)``; None for names lorasync did not make.

    Only the canonical form :func:`served_name` writes is lorasync's: ``q@v007`` or
    ``p@v99999999999999999999`` (loaded by someone else) are foreign, so a publisher never reads
    a version out of them, never unloads them and never fails because of them.

    Args:
        served: a name an engine lists (anything: engines may list odd values).

    Returns:
        `tuple[str, int] | None`: ``(name, version)``, or None for a foreign name.
    """
    if not isinstance(served, str):
        return None
    match = _SERVED.fullmatch(served)
    if match is None:
        return None
    try:
        return validate_name(match["name"]), validate_version(int(match["version"]))
    except InvalidNameError:
        return None
