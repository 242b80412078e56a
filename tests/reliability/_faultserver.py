"""A loopback engine server with injectable faults, speaking vLLM's or SGLang's runtime-LoRA HTTP
protocol (the routes and bodies of engine-contract.md §1-2), written on raw asyncio streams so
connection-level faults are real: refused connects, hung requests, connections dropped before or
in the middle of a response, a process "restart" that forgets every adapter.

It serves no model. A load reads the adapter directory the way an engine does (``Adapter.load``)
and compares it with the content hash the publisher recorded next to it, so a torn or partial
version would be caught at the engine. It keeps ground truth for the tests: what is loaded, how
many requests reached each route, and the max version of each name after every change.

Runs in a background thread with its own event loop; bind address 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorasync.adapter._names import parse_served_name

__all__ = ["FAULTS", "Fault", "FaultServer", "Loaded"]

# Fault kinds. "landed" (where it applies) means the engine performed the operation before the
# fault hit its answer.
FAULTS = (
    "refuse",  # nothing listens on the port (connect fails)
    "hang",  # request read, never answered (client times out)
    "500", "502", "503", "504",  # that status with an error body
    "empty200",  # 200 with an empty body
    "text200",  # 200 with a plain-text body that is not the engine's success text
    "json200err",  # 200 with a JSON body carrying an error
    "drop",  # status line, headers and half the body, then the connection closes
    "reset",  # the connection closes before any answer
    "restart",  # the engine crashes mid-request and comes back at once, having forgotten everything
    "restart_after",  # the engine answers success, then crashes and comes back empty
)  # fmt: skip

ROUTES = {
    "vllm": {
        "load": ("POST", "/v1/load_lora_adapter"),
        "unload": ("POST", "/v1/unload_lora_adapter"),
        "models": ("GET", "/v1/models"),
        "caps": ("GET", "/v1/load_lora_adapter"),
    },
    "sglang": {
        "load": ("POST", "/load_lora_adapter"),
        "unload": ("POST", "/unload_lora_adapter"),
        "models": ("GET", "/v1/models"),
        "caps": ("GET", "/server_info"),
    },
}

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}  # fmt: skip


@dataclass
class Fault:
    """One armed fault: ``kind`` on requests to ``route`` (a key of ``ROUTES`` or ``"*"``),
    for the next ``times`` matching requests (None: until disarmed)."""

    kind: str
    route: str = "load"
    times: int | None = None
    landed: bool = False
    hits: int = 0


@dataclass
class Loaded:
    """An adapter the engine serves: where it was read from and what was in it."""

    name: str
    path: str
    content_hash: str | None


@dataclass
class _State:
    adapters: dict[str, Loaded] = field(default_factory=dict)
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    loads_landed: int = 0
    restarts: int = 0
    torn: list[str] = field(default_factory=list)  # problems seen while reading a version
    max_seen: dict[str, list[int]] = field(default_factory=dict)  # name -> max version after each change
    auth_failures: int = 0
    keys_seen: set[str] = field(default_factory=set)


class FaultServer:
    """See the module docstring.

    Args:
        protocol: ``"vllm"`` or ``"sglang"``.
        api_key: when set, routes that need it (vLLM ``/v1/*``, every SGLang admin route) answer
            401 without ``Authorization: Bearer <api_key>``.
        read_files: read and check every loaded directory (off: accept any path).
        hang_s: how long a hung request stays open before the server gives up on it.
    """

    def __init__(self, protocol: str = "vllm", *, api_key: str | None = None, read_files: bool = True, hang_s: float = 3.0) -> None:
        if protocol not in ROUTES:
            raise ValueError(f"protocol must be one of {sorted(ROUTES)}")
        self.protocol = protocol
        self.routes = ROUTES[protocol]
        self.host = "127.0.0.1"
        self.port = 0
        self.api_key = api_key
        self.read_files = read_files
        self.hang_s = hang_s
        self._state = _State()
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._wake: asyncio.Event
        self._handlers: set[asyncio.Task[Any]] = set()

    # -- lifecycle (called from the test's thread) ------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FaultServer:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-server", daemon=True)
        self._thread.start()
        self._call(self._make_event())
        self._call(self._listen())
        return self

    async def _make_event(self) -> None:
        self._wake = asyncio.Event()

    def stop(self) -> None:
        if self._loop is None:
            return
        self._call(self._close(listener=True))
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(5)
        self._loop.close()
        self._loop = None

    def __enter__(self) -> FaultServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _call(self, coro: Any) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    # -- fault control -------------------------------------------------------------------------------

    def arm(self, kind: str, route: str = "load", *, times: int | None = None, landed: bool = False) -> None:
        """Inject ``kind`` on ``route``; ``"refuse"`` closes the listener (and open connections)."""
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}")
        if kind == "refuse":
            self._call(self._close(listener=True))
            return
        with self._lock:
            self._faults.append(Fault(kind, route, times, landed))

    def disarm(self) -> None:
        """Remove every fault and listen again."""
        with self._lock:
            self._faults.clear()
        self._call(self._listen())

    def restart(self) -> None:
        """Forget every adapter and drop every connection, as a restarted engine would."""
        self._call(self._restart())

    # -- ground truth ------------------------------------------------------------------------------

    @property
    def adapters(self) -> dict[str, Loaded]:
        with self._lock:
            return dict(self._state.adapters)

    def requests(self, route: str) -> int:
        """Requests that reached ``route`` (a key of ``ROUTES``) since the last ``reset_counts``."""
        with self._lock:
            return self._state.requests[self.routes[route]]

    def reset_counts(self) -> None:
        with self._lock:
            self._state.requests.clear()

    @property
    def stats(self) -> dict[str, Any]:
        with self._lock:
            s = self._state
            return {
                "loads_landed": s.loads_landed,
                "restarts": s.restarts,
                "torn": list(s.torn),
                "max_seen": {k: list(v) for k, v in s.max_seen.items()},
                "auth_failures": s.auth_failures,
                "keys_seen": set(s.keys_seen),
            }

    def versions(self, name: str) -> list[int]:
        """Versions of ``name`` served now, ascending."""
        out = []
        for served in self.adapters:
            parsed = parse_served_name(served)
            if parsed is not None and parsed[0] == name:
                out.append(parsed[1])
        return sorted(out)

    # -- the server (event-loop thread) -------------------------------------------------------------

    async def _listen(self) -> None:
        if self._server is not None:
            return
        self._server = await asyncio.start_server(self._handle, self.host, self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self, *, listener: bool) -> None:
        if listener and self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        self._wake.set()  # hung requests end with their connection
        self._wake = asyncio.Event()
        if listener and self._handlers:  # stopping: let every connection's handler finish
            await asyncio.wait(list(self._handlers), timeout=2)

    async def _restart(self) -> None:
        with self._lock:
            self._state.adapters.clear()
            self._state.restarts += 1
            for name in list(self._state.max_seen):
                self._record(name)
        await self._close(listener=False)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                line = await reader.readline()
                if not line.strip():
                    break
                method, target = line.decode("latin-1").split(" ")[:2]
                headers: dict[str, str] = {}
                while True:
                    raw = await reader.readline()
                    if raw in (b"\r\n", b"\n", b""):
                        break
                    key, _, value = raw.decode("latin-1").partition(":")
                    headers[key.strip().lower()] = value.strip()
                size = int(headers.get("content-length") or 0)
                body = await reader.readexactly(size) if size else b""
                if not await self._serve(method, target.split("?")[0], headers, body, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self._writers.discard(writer)
            self._handlers.discard(task)
            writer.close()

    def _fault_for(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.times is not None and fault.hits >= fault.times:
                    continue
                if fault.route == "*" or self.routes.get(fault.route) == (method, path):
                    fault.hits += 1
                    return fault
        return None

    async def _serve(self, method: str, path: str, headers: dict[str, str], body: bytes, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False closes the connection."""
        with self._lock:
            self._state.requests[(method, path)] += 1
        fault = self._fault_for(method, path)
        landed = fault is None or fault.landed or fault.kind == "restart_after"
        # The engine does the work only when no fault, or a fault after the work, hits.
        status, payload, ctype = self._route(method, path, headers, body) if landed else (200, b"Success" * 8, None)
        if fault is None:
            await _send(writer, status, payload, ctype)
            return True
        kind = fault.kind
        if kind == "restart":
            await self._restart()
            return False
        if kind == "hang":
            try:
                await asyncio.wait_for(self._wake.wait(), self.hang_s)
            except asyncio.TimeoutError:
                pass
            return False
        if kind == "reset":
            return False
        if kind == "restart_after":
            await _send(writer, status, payload, ctype)
            await self._restart()
            return False
        if kind == "drop":
            head = f"HTTP/1.1 200 OK\r\ncontent-length: {len(payload) + 64}\r\n\r\n".encode()
            writer.write(head + payload[: max(1, len(payload) // 2)])
            await writer.drain()
            return False
        if kind == "500":
            await _send(writer, 500, self._error_body("Internal Server Error (injected)", 500), "application/json")
        elif kind in ("502", "503", "504"):  # what a proxy in front of the engine answers
            code = int(kind)
            await _send(writer, code, f"<html><body>{code} {_REASONS[code]}</body></html>".encode(), "text/html")
        elif kind == "empty200":
            await _send(writer, 200, b"", None)
        elif kind == "text200":
            await _send(writer, 200, b"OK", "text/plain")
        elif kind == "json200err":
            await _send(writer, 200, self._error_body("Call to add_lora method failed: injected error", 500), "application/json")
        return True

    # -- protocol ------------------------------------------------------------------------------------

    def _error_body(self, message: str, code: int) -> bytes:
        if self.protocol == "vllm":
            return json.dumps({"error": {"message": message, "type": "InternalServerError", "param": None, "code": code}}).encode()
        return json.dumps({"rid": None, "http_worker_ipc": None, "success": False, "error_message": message, "loaded_adapters": None}).encode()

    def _authorized(self, path: str, headers: dict[str, str]) -> bool:
        auth = headers.get("authorization", "")
        if auth.startswith("Bearer "):
            with self._lock:
                self._state.keys_seen.add(auth[len("Bearer ") :])
        if self.api_key is None:
            return True
        guarded = path.startswith("/v1") if self.protocol == "vllm" else path not in ("/health",)
        if guarded and auth != f"Bearer {self.api_key}":
            with self._lock:
                self._state.auth_failures += 1
            return False
        return True

    def _route(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes, str | None]:
        if not self._authorized(path, headers):
            return 401, b'{"error":"Unauthorized"}', "application/json"
        data = json.loads(body) if body.strip() else {}
        key = (method, path)
        if path == "/health":
            return 200, b"", None
        if self.protocol == "vllm":
            if key == ("GET", "/version"):
                return _json({"version": "0.32.0"})
            if key == ("GET", "/v1/load_lora_adapter"):
                return 405, b'{"detail":"Method Not Allowed"}', "application/json"
            if key == ("GET", "/metrics"):
                # vLLM 0.32's gauge of adapters with requests: this peer runs none.
                gauge = f'vllm:lora_requests_info{{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""}} {time.time()}\n'
                return 200, gauge.encode(), "text/plain; version=0.0.4; charset=utf-8"
        else:
            if key == ("GET", "/server_info"):
                return _json({
                    "version": "0.5.23", "enable_lora": True, "max_lora_rank": 64, "lora_target_modules": None,
                    "max_loaded_loras": None, "max_loras_per_batch": 8, "dp_size": 1, "tp_size": 1,
                    "tokenizer_worker_num": 1,
                })  # fmt: skip
        if key == ("GET", "/v1/models"):
            return _json({"object": "list", "data": self._cards()})
        if key == self.routes["load"]:
            return self._load(str(data.get("lora_name") or ""), str(data.get("lora_path") or ""))
        if key == self.routes["unload"]:
            return self._unload(str(data.get("lora_name") or ""))
        return 404, b'{"detail":"Not Found"}', "application/json"

    def _cards(self) -> list[dict[str, Any]]:
        base = {"id": "fault-base", "object": "model", "root": "/models/fault-base", "parent": None}
        with self._lock:
            adapters = list(self._state.adapters.values())
        return [base] + [{"id": a.name, "object": "model", "root": a.path, "parent": "fault-base"} for a in adapters]

    def _load(self, name: str, path: str) -> tuple[int, bytes, str | None]:
        with self._lock:
            if name in self._state.adapters:
                if self.protocol == "vllm":
                    msg = f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."
                    return _vllm_error(msg, "InvalidUserInput", 400)
                return 400, self._error_body(f"Failed to load LoRA adapter {name} because it is already loaded", 400), "application/json"
        directory = Path(path)
        if not (directory / "adapter_config.json").is_file():
            if self.protocol == "vllm":
                return _vllm_error(f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError", 404)
            return 400, self._error_body(f"[Errno 2] No such file or directory: '{path}/adapter_config.json'", 400), "application/json"
        digest = None
        if self.read_files:
            problem, digest = _read_version(directory)
            if problem is not None:
                with self._lock:
                    self._state.torn.append(f"{name} from {path}: {problem}")
                msg = f"Call to add_lora method failed: Worker failed with error '{problem}', please check the stack trace above for the root cause"
                return 500, self._error_body(msg, 500), "application/json"
        with self._lock:
            self._state.adapters[name] = Loaded(name, path, digest)
            self._state.loads_landed += 1
            self._record_served(name)
        if self.protocol == "vllm":
            return 200, f"Success: LoRA adapter '{name}' added successfully.".encode(), None
        return self._sglang_ok()

    def _unload(self, name: str) -> tuple[int, bytes, str | None]:
        with self._lock:
            if name not in self._state.adapters:
                if self.protocol == "vllm":
                    return _vllm_error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
                loaded = list(self._state.adapters)
                return 400, self._error_body(f"LoRA with name {name} does not exist. Loaded LoRAs: odict_keys({loaded})", 400), "application/json"
            del self._state.adapters[name]
            self._record_served(name)
        if self.protocol == "vllm":
            return 200, f"Success: LoRA adapter '{name}' removed successfully.".encode(), None
        return self._sglang_ok()

    def _sglang_ok(self) -> tuple[int, bytes, str | None]:
        with self._lock:
            loaded = {a.name: a.path for a in self._state.adapters.values()}
        return _json({"rid": None, "http_worker_ipc": None, "success": True, "error_message": "", "loaded_adapters": loaded})

    def _record_served(self, served: str) -> None:
        parsed = parse_served_name(served)
        if parsed is not None:
            self._record(parsed[0])

    def _record(self, name: str) -> None:
        # caller holds the lock
        versions = [p[1] for n in self._state.adapters if (p := parse_served_name(n)) is not None and p[0] == name]
        history = self._state.max_seen.setdefault(name, [])
        top = max(versions, default=-1)
        if not history or history[-1] != top:
            history.append(top)


def _read_version(directory: Path) -> tuple[str | None, str | None]:
    """Read a version directory like an engine; ``(problem, content_hash)``."""
    from lorasync.adapter._adapter import Adapter
    from lorasync.errors import LoraSyncError

    try:
        adapter = Adapter.load(directory)
    except (LoraSyncError, OSError, ValueError) as exc:
        return f"unreadable adapter: {type(exc).__name__}: {exc}", None
    meta = directory / "lorasync.json"
    if meta.is_file():
        try:
            recorded = json.loads(meta.read_text())["content_hash"]
        except (OSError, ValueError, KeyError) as exc:
            return f"bad lorasync.json: {exc}", None
        if recorded != adapter.content_hash:
            return f"content hash {adapter.content_hash[:12]} differs from the recorded {recorded[:12]}", None
    return None, adapter.content_hash


def _vllm_error(message: str, kind: str, code: int) -> tuple[int, bytes, str]:
    """vLLM's (>= 0.10.1) error envelope."""
    return code, json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode(), "application/json"


def _json(value: Any) -> tuple[int, bytes, str]:
    return 200, json.dumps(value).encode(), "application/json"


async def _send(writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str | None) -> None:
    head = f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\ncontent-length: {len(body)}\r\n"
    if ctype:
        head += f"content-type: {ctype}\r\n"
    writer.write(head.encode() + b"\r\n" + body)
    await writer.drain()


def wait_until(predicate: Any, timeout: float = 5.0) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())
