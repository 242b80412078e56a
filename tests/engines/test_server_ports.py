"""Ports of the servers tests start, with a second process on the machine picking ports too (the
suite runs on two pytest workers): a port picked free may be taken before the server binds it.

``VLLMServer`` then counts ``/health`` only from its own process group's socket, and picks another
port when vLLM cannot bind; ``refused_url`` keeps a "nothing listens here" port from being taken.
"""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from lorasync.testing._ports import group_listens
from lorasync.testing.vllm_server import VLLMServer, free_port, refused_url

LISTENER = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); print('up', flush=True); time.sleep(60)"


def test_group_listens_tells_the_groups_own_socket_from_anothers() -> None:
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", LISTENER, str(port)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        assert group_listens(child.pid, port) is True
        with socket.socket() as mine:  # a port this process listens on: not the child's group's
            mine.bind(("127.0.0.1", 0))
            mine.listen()
            assert group_listens(child.pid, mine.getsockname()[1]) is False
        assert group_listens(child.pid, free_port()) is False  # nobody listens there
    finally:
        child.kill()
        child.wait()


def test_refused_url_refuses_and_cannot_be_taken_while_held() -> None:
    with refused_url() as url:
        port = int(url.rsplit(":", 1)[1])
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
        with socket.socket() as other, pytest.raises(OSError):  # what another process's server would do
            other.bind(("127.0.0.1", port))
    with socket.socket() as other:  # released afterwards
        other.bind(("127.0.0.1", port))


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.vllm
def test_a_port_taken_before_vllm_binds_it_is_not_mistaken_for_the_server(
    vllm_python: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process (here an HTTP server answering 200 to everything) holds the port the server
    picked: its ``/health`` is not taken for vLLM's, vLLM fails to bind, and the server starts on
    another port, where it serves."""
    squatter = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    taken = squatter.server_address[1]
    picks = iter([taken])
    monkeypatch.setattr("lorasync.testing.vllm_server.free_port", lambda host="127.0.0.1": next(picks, None) or free_port(host))
    log = tmp_path / "vllm.log"
    try:
        with VLLMServer(tiny_model_dir, python=vllm_python, served_model_name="tiny-base", log_path=log) as server:
            assert server.port != taken
            assert group_listens(server.pid, server.port) is True
            models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
            assert [m["id"] for m in models["data"]] == ["tiny-base"]
        assert "Address already in use" in log.read_text(errors="replace")  # the first attempt could not bind
    finally:
        squatter.shutdown()
        squatter.server_close()


# -- VLLMServer's start, against a stand-in for vLLM's entry point (seconds, not a vLLM start) -------

FAKE_VLLM = """#!{python}
# Stands in for `python -m vllm.entrypoints.openai.api_server ...`: binds --host/--port as vLLM
# does (exits with EADDRINUSE when it cannot) and answers 200 to everything; --hang: never healthy.
import http.server, sys
args = sys.argv[1:]
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
print("torch c10d: Address already in use (a harmless warning of another component)", flush=True)
if "--hang" in args:
    import time
    time.sleep(600)
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer((host, port), Ok).serve_forever()
"""


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import lorasync.testing.venvs as venvs

    class Ready:
        def require(self) -> None:
            return None

    monkeypatch.setattr(venvs, "engine_venv", lambda *a, **k: Ready())
    python = tmp_path / "python"
    python.write_text(FAKE_VLLM.format(python=sys.executable))
    python.chmod(0o755)
    return python


def _picks(monkeypatch: pytest.MonkeyPatch, first: list[int]) -> list[int]:
    """Make VLLMServer pick ``first`` ports first, then free ones; returns every port it picked."""
    picked: list[int] = []
    queue = list(first)

    def pick(host: str = "127.0.0.1") -> int:
        picked.append(queue.pop(0) if queue else free_port(host))
        return picked[-1]

    monkeypatch.setattr("lorasync.testing.vllm_server.free_port", pick)
    return picked


@pytest.mark.parametrize("port", [None, 0])
def test_a_picked_port_that_is_taken_is_picked_again(fake_vllm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, port: int | None) -> None:
    squatter = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)  # answers 200 to /health
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    picked = _picks(monkeypatch, [squatter.server_address[1]])
    try:
        with VLLMServer("/model", python=fake_vllm, port=port, log_path=tmp_path / "log", startup_timeout=30) as server:
            assert len(picked) == 2 and server.port == picked[1] != picked[0]
            assert group_listens(server.pid, server.port) is True
    finally:
        squatter.shutdown()
        squatter.server_close()


def test_a_port_the_caller_chose_is_not_changed(fake_vllm: Path, tmp_path: Path) -> None:
    from lorasync.errors import EngineUnavailableError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = VLLMServer("/model", python=fake_vllm, port=port, log_path=tmp_path / "log", startup_timeout=30)
        with pytest.raises(EngineUnavailableError, match="exited"):
            server.start()
        assert server.port == port


def test_a_start_that_times_out_is_not_retried_on_another_port(fake_vllm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its log says "Address already in use" (another component's warning), but the server never
    exited: the timeout is raised after one attempt, not three."""
    from lorasync.errors import EngineTimeoutError

    picked = _picks(monkeypatch, [])
    server = VLLMServer("/model", python=fake_vllm, log_path=tmp_path / "log", startup_timeout=2, extra_args=("--hang",))
    with pytest.raises(EngineTimeoutError):
        server.start()
    assert len(picked) == 1 and not server.alive()


def test_group_listens_reads_every_process_name(tmp_path: Path) -> None:
    """A process of anybody's whose name the kernel cut inside a UTF-8 character (15 bytes) is
    just another process, not a crash of the scan."""
    odd = tmp_path / "comptes_rendu_été"  # byte 15 is the first half of "é"
    odd.symlink_to(sys.executable)
    other = subprocess.Popen([str(odd), "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{other.pid}/comm").read_bytes().rstrip(b"\n") != "comptes_rendu_é".encode()[:15]:
            assert time.monotonic() < deadline, "the process did not take its name"
            time.sleep(0.05)
        assert group_listens(os.getpgid(os.getpid()), free_port()) is False
    finally:
        other.kill()
        other.wait()


def test_refused_url_holds_ipv6_ports_too() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        context = refused_url("::1")
        url = context.__enter__()
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    try:
        assert url.startswith("http://[::1]:")
        with pytest.raises(httpx.ConnectError):
            httpx.get(url, timeout=2)
    finally:
        context.__exit__(None, None, None)


def test_start_all_stops_every_server_when_one_fails() -> None:
    """A failed start among several (start_all): every start is waited for, then every server is
    stopped, so none comes up after the caller's cleanup and outlives it."""
    from lorasync.testing.vllm_server import start_all

    class Fake:
        def __init__(self, fail: bool, delay: float) -> None:
            self.fail, self.delay, self.running, self.stops = fail, delay, False, 0

        def start(self) -> None:
            time.sleep(self.delay)
            if self.fail:
                raise RuntimeError("vLLM exited during startup")
            self.running = True

        def stop(self) -> None:
            self.stops += 1
            self.running = False

    servers = [Fake(fail=True, delay=0.0), Fake(fail=False, delay=0.3), Fake(fail=False, delay=0.1)]
    with pytest.raises(RuntimeError, match="exited during startup"):
        start_all(servers)  # type: ignore[arg-type]
    assert [s.running for s in servers] == [False, False, False]
    assert all(s.stops == 1 for s in servers)


_ANSWERING = r'''
import sys, http.server
port, body = int(sys.argv[1]), sys.argv[2].encode()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.mark.parametrize("body", ["[]", '{"urls": null}', '{"urls": [1]}'])
def test_a_helper_answering_in_another_shape_is_a_typed_timeout_and_its_group_stops(body: str) -> None:
    # A router answering its worker list in a shape it never has (another service on the port, a
    # version that changed it) is "not ready yet" until the deadline: a typed error, nothing left running.
    from lorasync.errors import EngineTimeoutError
    from lorasync.testing.vllm_router import VLLMRouterProcess

    router = VLLMRouterProcess(["http://127.0.0.1:9"], startup_timeout=1.0)
    router.command = lambda: [sys.executable, "-c", _ANSWERING, str(router.port), body]  # type: ignore[method-assign]
    with pytest.raises(EngineTimeoutError, match="listing its workers"):
        router.start()
    assert router._proc is None
