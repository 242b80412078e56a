"""A misbehaving HTTP peer on 127.0.0.1 for the timeout and secret tests (issue 15).

Modes, per connection, after reading the request head and body:

* ``"trickle_head"``: the whole response (status line, headers, body) one byte every
  ``interval`` seconds;
* ``"trickle_body"``: status line and headers at once (``Content-Length`` set), the body one
  byte every ``interval`` seconds;
* ``"echo503"`` / ``"echo500"``: a 503 (retried) or 500 (not) whose body quotes the request's
  headers back (``Authorization`` included), the way some proxies' error pages do.

Bounded: the server closes every connection and stops listening ``lifetime`` seconds after it
started (or on :meth:`stop`), whatever the clients do.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

BODY = b'{"object": "list", "data": []}'


class SlowPeer:
    def __init__(self, mode: str, *, interval: float = 0.5, lifetime: float = 15.0) -> None:
        if mode not in ("trickle_head", "trickle_body", "echo503", "echo500"):
            raise ValueError(mode)
        self.mode, self.interval, self.lifetime = mode, interval, lifetime
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.1)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.requests = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> SlowPeer:
        self._deadline = time.monotonic() + self.lifetime
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        self._sock.close()

    def _running(self) -> bool:
        return not self._stop.is_set() and time.monotonic() < self._deadline

    def _accept(self) -> None:
        while self._running():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(0.2)
        try:
            while self._running():
                head = b""
                while b"\r\n\r\n" not in head and self._running():
                    try:
                        chunk = conn.recv(65536)
                    except TimeoutError:
                        continue
                    if not chunk:
                        return
                    head += chunk
                if not self._running():
                    return
                self.requests += 1
                header_text = head.split(b"\r\n\r\n", 1)[0]
                if self.mode in ("echo503", "echo500"):
                    body = b"upstream unavailable; request was:\n" + header_text
                    status = b"503 Service Unavailable" if self.mode == "echo503" else b"500 Internal Server Error"
                    conn.sendall(b"HTTP/1.1 %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body))
                    continue
                response = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
                start = 0
                if self.mode == "trickle_body":
                    start = response.index(b"\r\n\r\n") + 4
                    conn.sendall(response[:start])
                for i in range(start, len(response)):
                    if not self._running():
                        return
                    conn.sendall(response[i : i + 1])
                    self._stop.wait(self.interval)
        except OSError:
            return
        finally:
            conn.close()
