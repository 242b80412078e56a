"""A whole-request deadline for httpx's sync client: every socket read and write of an attempt
waits at most until the attempt's deadline, so a peer trickling a byte at a time cannot stretch
``timeout=``.

httpx has no option for this; :class:`DeadlineBackend` wraps httpcore's network backend (set on
the connection pool by :mod:`lorasync.engines._http`) and :data:`DEADLINE` carries the current
attempt's deadline per thread.
"""

from __future__ import annotations

import ssl
import threading
import time
from typing import Any

import httpcore

__all__ = ["DEADLINE", "DeadlineBackend"]


class _Deadline(threading.local):
    at: float | None = None  # time.monotonic() by which the current attempt must be done


DEADLINE = _Deadline()


def _left(timeout: float | None) -> float | None:
    """``timeout`` shortened to what is left of the current attempt's deadline.

    Raises:
        httpcore.ReadTimeout: the deadline has passed (httpx reports it as ``ReadTimeout``).
    """
    at = DEADLINE.at
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        raise httpcore.ReadTimeout("the request's total deadline passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose every read and write waits at most until the attempt's deadline."""

    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _left(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _left(timeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, _left(timeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's sync backend, its connections wrapped in :class:`_DeadlineStream`."""

    def __init__(self, backend: httpcore.NetworkBackend) -> None:
        self._backend = backend

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:  # fmt: skip
        return _DeadlineStream(self._backend.connect_tcp(host, port, _left(timeout), local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._backend.connect_unix_socket(path, _left(timeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)
