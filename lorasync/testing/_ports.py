"""Local TCP ports for test servers: who listens on a port, and a port that refuses connections.

A port picked with ``bind(0)`` is free when it is picked, not when the server binds it tens of
seconds later: another process on the machine (a second pytest worker, another job) may take it
meanwhile, and then a health check gets its answer from the wrong server. :func:`group_listens`
tells whether a process of the server's own group holds the listening socket, read from Linux's
``/proc`` (no library reads another process's sockets without it, and psutil is not a dependency
of lorasync). :func:`refused_url` holds a port bound but not listening, so that "nothing listens
there" stays true for as long as a test needs it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["group_listens", "refused_url"]

_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp


def _listening_inodes(port: int) -> set[str] | None:
    """Socket inodes listening on ``port`` (IPv4 and IPv6), or ``None`` where ``/proc`` can't tell."""
    inodes: set[str] = set()
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes if readable else None


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) == pgid:
                members.append(int(entry))
        except OSError:  # it exited meanwhile
            continue
    return members


def group_listens(pgid: int, port: int) -> bool | None:
    """Whether a process of group ``pgid`` holds the socket listening on ``port``.

    Returns:
        ``True`` or ``False``; ``None`` where this machine has no ``/proc`` to tell.
    """
    inodes = _listening_inodes(port)
    if inodes is None:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for pid in _group_members(pgid):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return True
            except OSError:
                continue
    return False


@contextmanager
def refused_url(host: str = "127.0.0.1") -> Iterator[str]:
    """``http://host:port`` where nothing listens, for as long as the block runs: the port is
    bound here without listening, so connections are refused and no other process can take it.

    Args:
        host (`str`): an IPv4 or IPv6 address (not a name, which may stand for both).
    """
    v6 = ":" in host
    with socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        shown = f"[{host}]" if v6 else host
        yield f"http://{shown}:{sock.getsockname()[1]}"
