"""Secrets of the HTTP engine clients never leave as text or bytes (issue 28 item 25, and the two
suspected leaks checked with it).

The peers are real: a stdlib ``http.server`` on 127.0.0.1 that answers with the request it got
(path and headers, as some proxies' error pages and buggy engines do), and the reliability
suite's ``FaultServer``, which speaks vLLM's and SGLang's protocol and checks the API key. Every
test first checks that the peer really received the secret, so a leak would be real.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from lorasync.engines.sglang import SGLangEngine
from lorasync.engines.vllm import VLLMEngine
from lorasync.errors import AuthenticationError, ConfigError, EngineError, EngineUnavailableError
from tests.reliability._faultserver import FaultServer

ENGINES = {"vllm": VLLMEngine, "sglang": SGLangEngine}
SECRET = "sk-lorasync-7f3a9c1e5b2d4680"
PASSWORD = "pa:ss/w@rd#9"  # unencoded in the URL, as users paste them
TOKEN = "tok/en+9x&y=z"
TOKEN_URL = quote(TOKEN, safe="")
BASIC = base64.b64encode(f"trainer:{PASSWORD}".encode()).decode()
# Every form each secret may take in a text, worked out here independently of the library.
FORMS = {
    SECRET,
    PASSWORD,
    quote(PASSWORD, safe=""),
    BASIC,
    TOKEN,
    TOKEN_URL,
    str(httpx.QueryParams({"t": TOKEN}))[2:],
    json.dumps(TOKEN)[1:-1],
    json.dumps(PASSWORD)[1:-1],
}
ROOT = Path(__file__).resolve().parents[2]


class _Echo(BaseHTTPRequestHandler):
    """Answers ``status`` with the request line and headers in the body (``pad`` filler first;
    ``json``: inside a JSON error). ``status`` 200 answers an empty model list instead."""

    status = 500
    pad = 0
    as_json = False
    seen: list[tuple[str, dict[str, str]]]

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append((self.path, dict(self.headers)))
        if self.status == 200:
            body = b'{"object": "list", "data": []}'
        else:
            # The Authorization header first, so ``pad`` can put the cut of a quote inside it.
            headers = sorted(self.headers.items(), key=lambda kv: kv[0] != "Authorization")
            echo = f"{self.command} {self.path}\n" + "".join(f"{k}: {v}\n" for k, v in headers)
            text = json.dumps({"detail": {"path": self.path, "headers": dict(headers)}}) if self.as_json else echo
            body = ("x" * self.pad + text).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json" if self.as_json or self.status == 200 else "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def echo(status: int, *, pad: int = 0, as_json: bool = False) -> Iterator[tuple[str, list[tuple[str, dict[str, str]]]]]:
    """``(base URL, requests seen)`` of an echoing peer on 127.0.0.1."""
    seen: list[tuple[str, dict[str, str]]] = []
    handler = type("Echo", (_Echo,), {"status": status, "pad": pad, "as_json": as_json, "seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _engine(protocol: str, host: str, creds: str, **kwargs: Any) -> Any:
    """A client with one kind of secret: ``bearer`` (api_key=), ``basic`` (user:password@ in the
    URL) or ``query`` (``?token=`` in the URL). httpx sends one Authorization header, basic auth
    over the bearer key, and one kind each keeps every check independent of the others."""
    url = {
        "bearer": f"http://{host}",
        "basic": f"http://trainer:{PASSWORD}@{host}",
        "query": f"http://{host}/?token={TOKEN_URL}",
    }[creds]
    key = {"api_key": SECRET} if creds == "bearer" else {}
    return ENGINES[protocol](url, timeout=5.0, retries=0, **key, **kwargs)


def _texts(exc: BaseException) -> list[str]:
    """What a user or a log sees of an error."""
    out = [str(exc), repr(exc), repr(exc.args), "".join(traceback.format_exception(exc))]
    if isinstance(exc, EngineError):
        out += [repr(exc.context), str(pickle.loads(pickle.dumps(exc)))]
    return out


async def _alist(engine: Any) -> list[str]:
    """The async path (its own httpx client) once, then its client closed."""
    try:
        return await engine.alist_adapters()  # type: ignore[no-any-return]
    finally:
        await engine.aclose()


def _leaks(texts: list[str]) -> list[str]:
    return sorted(form for form in FORMS for text in texts if form in text)


def _sent(seen: list[tuple[str, dict[str, str]]], creds: str) -> None:
    """The peer got every secret: a leak in what follows would be real."""
    path, headers = seen[-1]
    if creds == "query":
        # After the route (before the fix it went before it: /?token=.../v1/models).
        assert path.endswith(f"?token={TOKEN_URL}") and not path.startswith("/?"), path
    else:
        assert headers["Authorization"] == (f"Bearer {SECRET}" if creds == "bearer" else f"Basic {BASIC}")


# -- a) an engine echoing the request (Authorization header, query) in its error ---------------


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("status", [400, 500, 503])
@pytest.mark.parametrize("creds", ["bearer", "basic", "query"])
@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_an_engine_echoing_the_request_in_its_error_leaks_no_secret(protocol: str, creds: str, status: int, as_json: bool) -> None:
    with echo(status, as_json=as_json) as (host, seen):
        engine = _engine(protocol, host, creds)
        texts: list[str] = []
        load = lambda: engine.load_adapter("a@v1", "/nonexistent/a")  # noqa: E731
        for call in (engine.list_adapters, engine.capabilities, load, lambda: asyncio.run(_alist(engine))):
            with pytest.raises(EngineError) as info:
                call()
            _sent(seen, creds)
            texts += _texts(info.value)
        engine.close()
    assert not _leaks(texts)
    if status == 503:
        assert isinstance(info.value, EngineUnavailableError)
    # The echo reached the messages, secrets replaced: scrubbing did not hide the peer's answer.
    shown = "token=***" if creds == "query" else ("Bearer ***" if creds == "bearer" else "Basic ***")
    assert any(shown in t for t in texts), texts[0]


@pytest.mark.parametrize("creds", ["bearer", "basic"])
@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_secret_cut_by_the_quote_limit_shows_no_part_of_it(protocol: str, creds: str) -> None:
    # Error messages quote the first 300 characters of a body: put that cut 10 characters into
    # the secret. Scrubbing after the cut (as before) missed the truncated secret and showed its head.
    value = f"Bearer {SECRET}" if creds == "bearer" else f"Basic {BASIC}"
    pad = 300 - len("GET /v1/models\nAuthorization: ") - len(value.split()[0]) - 1 - 10
    with echo(503, pad=pad) as (host, seen):
        engine = _engine(protocol, host, creds)
        with pytest.raises(EngineUnavailableError) as info:
            engine.list_adapters()
        _sent(seen, creds)
    secret = SECRET if creds == "bearer" else BASIC
    texts = _texts(info.value)
    assert not [t for t in texts if secret[:8] in t], info.value


# -- b) a token in the URL's query ---------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_query_token_is_sent_with_every_request_and_never_shown(protocol: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # httpx logs each request's URL at INFO
    caplog.set_level(logging.DEBUG, logger="httpx")  # whatever an earlier test (the CLI demo) set it to
    with echo(200) as (host, seen):
        engine = _engine(protocol, host, "query")
        assert engine.list_adapters() == [] and engine.list_adapters() == []  # on every request
        for path, _ in seen:
            assert path.endswith(f"?token={TOKEN_URL}") and not path.startswith("/?"), path
        texts = [repr(engine), engine.url, caplog.text]
        blob = pickle.dumps(engine)
        engine.close()
    assert engine.url == f"http://{host}" and repr(engine).endswith(f"(url='http://{host}', api_key=***)")
    assert "token=***" in caplog.text  # httpx's request log, scrubbed
    assert not _leaks(texts)
    assert not [form for form in FORMS if form.encode() in blob]
    # A URL that does not parse is quoted in the refusal, its query not.
    with pytest.raises(ConfigError, match="invalid engine URL") as info:
        ENGINES[protocol](f"http://127.0.0.1:port/?token={TOKEN_URL}")
    assert not _leaks(_texts(info.value))


# -- item 25: pickles ------------------------------------------------------------------------------


@pytest.mark.parametrize("creds", ["bearer", "basic", "query"])
@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_pickled_client_carries_no_secret_and_copies_keep_it(protocol: str, creds: str) -> None:
    with echo(200) as (host, seen):
        engine = _engine(protocol, host, creds)
        engine.list_adapters()  # an open connection pool must not stop the pickle either
        _sent(seen, creds)
        for protocol_no in range(2, pickle.HIGHEST_PROTOCOL + 1):
            blob = pickle.dumps(engine, protocol=protocol_no)
            assert not [form for form in FORMS if form.encode() in blob], protocol_no
        # A copy in this process is the same client: it still authenticates.
        twin = copy.deepcopy(engine)
        twin.list_adapters()
        _sent(seen, creds)
        twin.close()
        engine.close()


@pytest.mark.parametrize("creds", ["bearer", "basic", "query"])
@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_an_unpickled_client_without_its_secret_sends_nothing_and_says_how(protocol: str, creds: str) -> None:
    with echo(200) as (host, seen):
        engine = _engine(protocol, host, creds)
        back = pickle.loads(pickle.dumps(engine))
        assert repr(back) == repr(engine)
        with pytest.raises(AuthenticationError, match="api_key_env="):
            asyncio.run(_alist(back))
        with pytest.raises(AuthenticationError, match="api_key_env=") as info:
            back.list_adapters()
        assert seen == []  # refused before sending: no unauthenticated request reached the engine
        what = {"bearer": "API key given as api_key=", "basic": "user:password in the engine URL", "query": "query of the engine URL"}
        assert what[creds] in str(info.value) and info.value.engine == protocol and info.value.url.startswith(f"http://{host}/")
        assert not _leaks(_texts(info.value))
        engine.close()


@pytest.mark.parametrize(("protocol", "variable"), [("vllm", "LORASYNC_TEST_ENGINE_KEY"), ("sglang", "SGLANG_API_KEY")])
def test_a_key_from_the_environment_is_read_again_in_the_process_that_unpickles(
    protocol: str, variable: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM: a variable the user named (api_key_env=); SGLang: the standard one the client reads.
    monkeypatch.setenv(variable, SECRET)
    named = {"api_key_env": variable} if protocol == "vllm" else {}
    # One other process (importing lorasync is the slow part): it unpickles with the variable
    # set, then again without it.
    child = (
        "import os, pickle, sys\n"
        "from lorasync.errors import AuthenticationError\n"
        "for has_key in (True, False):\n"
        "    if not has_key:\n"
        "        del os.environ[sys.argv[2]]\n"
        "    engine = pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "    try:\n"
        "        print('served', engine.list_adapters())\n"
        "    except AuthenticationError as exc:\n"
        "        print('refused', exc)\n"
    )
    with FaultServer(protocol, api_key=SECRET) as server:
        engine = ENGINES[protocol](server.url, timeout=5.0, retries=0, **named)
        assert engine.list_adapters() == []
        blob = pickle.dumps(engine)
        assert SECRET.encode() not in blob
        (tmp_path / "engine.pkl").write_bytes(blob)
        done = subprocess.run(
            [sys.executable, "-c", child, str(tmp_path / "engine.pkl"), variable],
            capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, variable: SECRET},
        )
        engine.close()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    results = {True: lines[0], False: lines[1]}
    assert results[True] == "served []"  # the FaultServer checked the key: it was the right one
    assert results[False].startswith("refused") and f"${variable} is not set in this process" in results[False]
    assert SECRET not in results[False]


def test_a_named_key_variable_is_required_and_checked() -> None:
    with pytest.raises(ConfigError, match="not both"):
        VLLMEngine("http://127.0.0.1:9", api_key=SECRET, api_key_env="MY_KEY")
    with pytest.raises(ConfigError, match="api_key_env must name an environment variable"):
        SGLangEngine("http://127.0.0.1:9", api_key_env="MY KEY")
    os.environ.pop("LORASYNC_TEST_UNSET_KEY", None)
    engine = VLLMEngine("http://127.0.0.1:9", api_key_env="LORASYNC_TEST_UNSET_KEY", retries=0)
    with pytest.raises(AuthenticationError, match=r"\$LORASYNC_TEST_UNSET_KEY is not set in this process"):
        engine.list_adapters()  # refused before connecting (nothing listens on port 9)
