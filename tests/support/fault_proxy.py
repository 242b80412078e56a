"""A fault-injecting HTTP proxy in front of a real engine server (tests only).

It listens on 127.0.0.1 on a free port and forwards every request to ``upstream`` unchanged. A
fault armed on a route changes what the client sees of that route's next requests, while the
real engine does what it was asked:

* ``"empty200"``: the request is forwarded (the engine acts on it), the client gets HTTP 200 with
  an empty body.
* ``"drop"``: the request is forwarded, then the connection is closed without an answer.
* ``"drop_down"``: as ``"drop"``, then the proxy stops listening (the client's retries are
  refused) until :meth:`FaultProxy.up`: an engine restart as the client sees it.
* ``"slow"``: the request is forwarded and its answer held back ``delay`` seconds (past the
  client's timeout) before it is written.

:meth:`FaultProxy.down` / :meth:`FaultProxy.up` close and reopen the listening socket on the same
port (connections are refused meanwhile). Every request is recorded in ``hits``.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

__all__ = ["FaultProxy"]

FAULTS = ("empty200", "drop", "drop_down", "slow")
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}


@dataclass
class _Armed:
    fault: str
    times: int  # how many of the route's next requests get it (<0: every one until disarmed)
    delay: float = 0.0


@dataclass
class Hit:
    method: str
    path: str
    fault: str | None
    status: int | None = None  # the engine's real status (None: not forwarded or it failed)


@dataclass
class FaultProxy:
    """Forward to ``upstream``; inject faults per route (see the module docstring)."""

    upstream: str
    hits: list[Hit] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.upstream = self.upstream.rstrip("/")
        self._armed: dict[str, _Armed] = {}
        self._open: set[socket.socket] = set()  # accepted connections (a client's kept-alive ones)
        self._lock = threading.Lock()
        self._client = httpx.Client(base_url=self.upstream, timeout=300.0)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- faults -----------------------------------------------------------------------------------

    def arm(self, route: str, fault: str, *, times: int = 1, delay: float = 0.0) -> None:
        """Give the next ``times`` requests to ``route`` (a path, no query) ``fault``; ``times=-1``:
        every one until :meth:`disarm`."""
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; one of {FAULTS}")
        with self._lock:
            self._armed[route] = _Armed(fault, times, delay)

    def disarm(self, route: str | None = None) -> None:
        with self._lock:
            if route is None:
                self._armed.clear()
            else:
                self._armed.pop(route, None)

    def _take(self, path: str) -> _Armed | None:
        with self._lock:
            armed = self._armed.get(path)
            if armed is None:
                return None
            if armed.times > 0:
                armed.times -= 1
                if armed.times == 0:
                    del self._armed[path]
            return armed

    def faulted(self, route: str) -> list[Hit]:
        return [h for h in self.hits if h.path == route and h.fault is not None]

    # -- listening --------------------------------------------------------------------------------

    def up(self) -> None:
        """Listen (again) on the same port."""
        if self._server is not None:
            return
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
                pass

            def setup(self) -> None:
                super().setup()
                with proxy._lock:
                    proxy._open.add(self.connection)

            def finish(self) -> None:
                with proxy._lock:
                    proxy._open.discard(self.connection)
                try:
                    super().finish()
                except OSError:
                    pass

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                proxy._handle(self)

            def do_POST(self) -> None:  # noqa: N802
                proxy._handle(self)

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def down(self) -> None:
        """Stop listening and reset every open connection (as a process that dies): new connections
        are refused until :meth:`up`."""
        server, self._server = self._server, None
        if server is None:
            return
        self._close_listener(server)
        with self._lock:
            open_now, self._open = list(self._open), set()
        for sock in open_now:
            self._reset(sock)
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def close(self) -> None:
        self.down()
        self._client.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one request ------------------------------------------------------------------------------

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        path = handler.path.split("?", 1)[0]
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        armed = self._take(path)
        hit = Hit(handler.command, path, armed.fault if armed else None)
        self.hits.append(hit)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP}
        try:
            answer = self._client.request(handler.command, handler.path, content=body, headers=headers)
        except httpx.HTTPError:
            handler.close_connection = True
            self._abort(handler)
            return
        hit.status = answer.status_code
        if armed is not None and armed.fault in ("drop", "drop_down"):
            if armed.fault == "drop_down":
                # Refuse before the client's retry can connect; shutdown() must not run on the
                # serving thread's own request, so it goes to a thread of its own.
                self._close_listener(self._server)
                threading.Thread(target=self.down, daemon=True).start()
            handler.close_connection = True
            self._abort(handler)
            return
        if armed is not None and armed.fault == "slow":
            time.sleep(armed.delay)
        status, content = answer.status_code, answer.content
        out_headers = [(k, v) for k, v in answer.headers.items() if k.lower() not in _HOP]
        if armed is not None and armed.fault == "empty200":
            status, content, out_headers = 200, b"", []
        try:
            handler.send_response(status)
            for key, value in out_headers:
                handler.send_header(key, value)
            handler.send_header("Content-Length", str(len(content)))
            handler.end_headers()
            handler.wfile.write(content)
            handler.wfile.flush()
        except OSError:
            handler.close_connection = True  # the client gave up (its timeout) before the answer

    @staticmethod
    def _close_listener(server: ThreadingHTTPServer | None) -> None:
        if server is not None:
            try:
                server.socket.close()  # refused from now on; down() finishes the shutdown
            except OSError:
                pass

    @staticmethod
    def _abort(handler: BaseHTTPRequestHandler) -> None:
        """Close the connection without a byte of answer (RST, as a process that dies)."""
        FaultProxy._reset(handler.connection)

    @staticmethod
    def _reset(sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
