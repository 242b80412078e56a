"""Whether an engine URL names this host (the one "same host" test every engine client uses), and
which server a URL names (the one identity every per-server table keys by).

An engine on this host reads this host's files and shared memory (the disk and IPC transports
need that); any other host needs a shared root, an HTTP tensor route or the merged fallback.
"""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["LOCAL_HOSTS", "is_same_host", "server_key"]

# Loopback names, and 0.0.0.0 (connecting to it reaches this host).
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0"})


def is_same_host(url: str, override: bool | None = None) -> bool:
    """True when ``url`` reaches an engine on this host.

    Args:
        url (`str`): the engine's URL (``http://127.0.0.1:8000``).
        override (`bool`, *optional*): the user's explicit answer (an engine behind a
            non-loopback address that shares this host's filesystem); wins when given.

    Returns:
        `bool`: ``override`` if given, else whether the URL's host is a loopback name.
    """
    if override is not None:
        return override
    return (urlsplit(url).hostname or "") in LOCAL_HOSTS


def server_key(url: str) -> tuple[str, str, int, str] | None:
    """The identity of the HTTP server ``url`` names: one key for every spelling of one server.

    ``http://127.0.0.1:8000``, ``http://localhost:8000/`` and ``HTTP://[::1]:8000`` are one
    server (every loopback name reaches the local server on that port), so whatever is kept per
    server (a publisher's duplicate check, SGLang's one weight-update session) must not tell them
    apart (issue 33 item 22; two SessionGates of one SGLang collided on its one session).

    Args:
        url (`str`): an engine's URL.

    Returns:
        `tuple | None`: ``(scheme, host, port, path)`` with the scheme and host lower-cased, any
        loopback name as ``"loopback"``, the scheme's default port filled in and the path's
        trailing slash dropped; ``None`` for anything that is not an http(s) URL with a host (an
        in-process engine), which the caller keys some other way.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        return None
    host = parts.hostname.lower()
    host = "loopback" if host in LOCAL_HOSTS else host
    return (scheme, host, port or {"http": 80, "https": 443}[scheme], parts.path.rstrip("/"))
