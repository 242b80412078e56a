"""Ports of the servers tests start, with a second process on the machine picking ports too (the
suite runs on two pytest workers): a port picked free may be taken before the server binds it.

``VLLMServer`` then counts ``/health`` only from its own process group's socket, and picks another
port when vLLM cannot bind; ``refused_url`` keeps a "nothing listens here" port from being taken.
"""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
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
