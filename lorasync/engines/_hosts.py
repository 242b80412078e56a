"""Whether an engine URL names this host: the one "same host" test every engine client uses.

An engine on this host reads this host's files and shared memory (the disk and IPC transports
need that); any other host needs a shared root, an HTTP tensor route or the merged fallback.
"""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["LOCAL_HOSTS", "is_same_host"]

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
