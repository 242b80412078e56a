"""Credentials of an engine URL and API key, checked before use and never shown.

Used by :mod:`lorasync.engines._http`; nothing here logs or formats a secret into a message.
"""

from __future__ import annotations

from urllib.parse import unquote

import httpx

from lorasync.errors import ConfigError

__all__ = ["clean_key", "split_userinfo"]


def clean_key(key: str | None, origin: str) -> str | None:
    """The API key without the whitespace a key file or ``echo`` leaves around it.

    Raises:
        ConfigError: control or non-ASCII characters inside the key (the key is not shown).
    """
    if key is None:
        return None
    key = key.strip()
    if any(not (0x21 <= ord(c) <= 0x7E) for c in key):
        raise ConfigError(
            f"the API key from {origin} contains spaces, control or non-ASCII characters inside it (not shown); "
            "pass the exact key the server was started with (--api-key), one line, no quotes"
        )
    return key or None


def split_userinfo(url: str) -> tuple[str, str | None, str | None]:
    """``(url without credentials, user, password)``; user/password percent-decoded.

    The credentials end at the last ``@`` of the authority, so a password may hold ``#``, ``/``,
    ``?`` or ``@`` unencoded (a standard parser would end the authority early and take part of the
    password for a host or port). A URL with ``@`` in its path is not supported.

    Raises:
        ConfigError: a URL that is still invalid once the credentials are out (never shown
            with them).
    """
    if not isinstance(url, str) or not url:
        raise ConfigError(f"engine URL must be a non-empty string such as 'http://127.0.0.1:8000', got {url!r}")
    scheme, sep, rest = url.partition("://")
    user = password = None
    if sep and "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
        name, colon, secret = userinfo.partition(":")
        user, password = unquote(name), (unquote(secret) if colon else "")
        url = f"{scheme}://{rest}"
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        shown = str(exc).replace(password, "***") if password else str(exc)
        raise ConfigError(
            f"invalid engine URL {url!r} ({shown}); use http://host:port (credentials, if any, as user:password@)"
        ) from None
    if parsed.userinfo:  # only possible without "://" handling above: keep it out of the URL
        user, password = parsed.username, parsed.password
        parsed = parsed.copy_with(userinfo=b"")
    return str(parsed), user, password
