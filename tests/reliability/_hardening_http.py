"""HTTP engine clients against misbehaving peers (issue 15): a trickling server cannot stretch
``timeout=`` (it bounds a whole request), and no secret (API key, URL password) reaches an error,
report, traceback or log, whatever the key file or the peer sends."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from lorasync import Publisher, RetryPolicy
from lorasync.engines import parse_engine_spec
from lorasync.errors import ConfigError, EngineError, EngineTimeoutError, EngineUnavailableError

from ._faultserver import FaultServer
from ._harness import client, tiny_adapter
from ._slowpeer import SlowPeer

TIMEOUT = 1.0
ATTEMPTS = 2
POLICY = RetryPolicy(attempts=ATTEMPTS, backoff=0.01, backoff_max=0.01, jitter=0.0)
SLACK = 1.5  # scheduling on a busy 2-core box
SECRET = "sk-lorasync-4be1c0de-never-show"


def run_trickle() -> dict[str, Any]:
    """``list_adapters(timeout=1.0)`` with 2 attempts against a peer sending one byte every
    0.5 s (headers or body), sync and async, vLLM and SGLang clients: each call must fail with
    ``EngineTimeoutError`` within 2 x 1.0 s (+ slack); ``longest`` is the slowest call (s)."""
    tried = handled = 0
    longest = 0.0
    violations: list[str] = []
    for mode in ("trickle_head", "trickle_body"):
        for protocol in ("vllm", "sglang"):
            for io_kind in ("sync", "async"):
                tried += 1
                with SlowPeer(mode, interval=0.5, lifetime=10.0) as peer:
                    engine = client(protocol, peer.url, timeout=TIMEOUT, retries=POLICY)
                    start = time.monotonic()
                    try:
                        if io_kind == "sync":
                            engine.list_adapters()
                        else:
                            asyncio.run(engine.alist_adapters())
                        outcome: Any = "returned"
                    except Exception as exc:  # noqa: BLE001 - judged below
                        outcome = exc
                    elapsed = time.monotonic() - start
                    engine.close()
                longest = max(longest, elapsed)
                label = f"{protocol} {io_kind} {mode}"
                if not isinstance(outcome, EngineTimeoutError):
                    violations.append(f"{label}: {type(outcome).__name__} after {elapsed:.1f}s instead of EngineTimeoutError")
                elif elapsed > ATTEMPTS * TIMEOUT + SLACK:
                    violations.append(f"{label}: took {elapsed:.1f}s (limit {ATTEMPTS * TIMEOUT:.1f}s + slack)")
                else:
                    handled += 1
    return {"tried": tried, "handled": handled, "longest": round(longest, 2), "violations": violations}


@contextlib.contextmanager
def _debug_log() -> Iterator[io.StringIO]:
    """Everything every logger writes at DEBUG while the block runs."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setLevel(logging.DEBUG)
    root = logging.getLogger()
    before = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield buffer
    finally:
        root.removeHandler(handler)
        root.setLevel(before)


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _texts(obj: Any) -> list[str]:
    """Every text a user could see of ``obj``: str, repr, context, the traceback with its chain."""
    out = [str(obj), repr(obj)]
    if isinstance(obj, BaseException):
        out += ["".join(traceback.format_exception(obj)), repr(getattr(obj, "context", None))]
    if hasattr(obj, "to_dict"):
        out.append(json.dumps(obj.to_dict(), default=str))
    return out


def run_secrets() -> dict[str, Any]:
    """Keys with a trailing newline work (stripped), keys with control characters inside are
    refused without being shown, a peer echoing the Authorization header does not leak it, and
    URL passwords holding ``#``, ``/``, ``?``, ``@`` work and never show."""
    tried = handled = 0
    violations: list[str] = []
    texts: list[tuple[str, str]] = []
    secrets = [SECRET]

    def case(label: str, ok: bool, why: str = "") -> None:
        nonlocal tried, handled
        tried += 1
        if ok:
            handled += 1
        else:
            violations.append(f"{label}: {why}")

    with _debug_log() as log, tempfile.TemporaryDirectory(prefix="lorasync-secrets-") as tmp:
        root = Path(tmp)
        key_file = root / "key.txt"
        key_file.write_text(SECRET + "\n")  # as `echo $KEY > key.txt` writes it
        for protocol, env in (("vllm", "VLLM_API_KEY"), ("sglang", "SGLANG_API_KEY")):
            with FaultServer(protocol, api_key=SECRET) as server:
                for how in ("key file", "env var", "CRLF"):
                    label = f"{protocol}: key with a trailing newline ({how})"
                    try:
                        if how == "env var":
                            with _env(env, SECRET + "\n"):
                                engine = client(protocol, server.url)
                        else:
                            raw = key_file.read_text() if how == "key file" else SECRET + "\r\n"
                            engine = client(protocol, server.url, api_key=raw)
                        name = "k" + how.replace(" ", "-")  # one server for the three: a name each
                        pub = Publisher([engine], name=name, root=root / f"{protocol}-{how}", transport="disk")
                        report = pub.publish(tiny_adapter(1), version=1)
                        texts.extend((label, t) for t in _texts(report) + _texts(engine))
                        case(label, report.ok, f"publish failed: {report}")
                        pub.close()
                        engine.close()
                    except Exception as exc:  # noqa: BLE001
                        texts.extend((label, t) for t in _texts(exc))
                        case(label, False, f"{type(exc).__name__}")
            for bad in (SECRET[:10] + "\x01" + SECRET[10:], SECRET[:10] + "\n" + SECRET[10:], SECRET[:10] + " " + SECRET[10:], SECRET + "é"):
                label = f"{protocol}: key with {bad[10]!r} inside"
                secrets.append(bad)
                try:
                    client(protocol, "http://127.0.0.1:9", api_key=bad)
                except ConfigError as exc:
                    texts.extend((label, t) for t in _texts(exc))
                    case(label, True)
                except Exception as exc:  # noqa: BLE001
                    texts.extend((label, t) for t in _texts(exc))
                    case(label, False, f"{type(exc).__name__} instead of ConfigError")
                else:
                    case(label, False, "accepted")
            for mode in ("echo503", "echo500"):
                with SlowPeer(mode, lifetime=10.0) as peer:
                    label = f"{protocol}: a peer quoting the Authorization header in its error ({mode})"
                    engine = client(protocol, peer.url, api_key=SECRET, retries=POLICY)
                    try:
                        engine.list_adapters()
                        case(label, False, "no error")
                    except EngineError as exc:
                        texts.extend((label, t) for t in _texts(exc))
                        wanted = ATTEMPTS if mode == "echo503" else 1
                        ok = peer.requests == wanted and (mode == "echo500" or isinstance(exc, EngineUnavailableError))
                        case(label, ok, f"{type(exc).__name__} after {peer.requests} requests")
                    except Exception as exc:  # noqa: BLE001
                        texts.extend((label, t) for t in _texts(exc))
                        case(label, False, f"{type(exc).__name__}")
                    pub = Publisher([engine], name="k", root=root / f"{protocol}-{mode}", transport="disk")
                    report = pub.publish(tiny_adapter(2), version=2)
                    texts.extend((label + " (report)", t) for t in _texts(report))
                    pub.close()
                    engine.close()
        with FaultServer("vllm") as server:
            host = server.url.removeprefix("http://")
            for password in ("pa#ss" + SECRET, "p/ss" + SECRET, "p?ss" + SECRET, "p@ss" + SECRET, "p:#/?@" + SECRET, "p%23" + SECRET):
                label = f"URL password {password[:6]!r}..."
                secrets.append(password)
                try:
                    engine = parse_engine_spec(f"vllm:http://trainer:{password}@{host}")
                    served = engine.list_adapters()
                    want = httpx.BasicAuth("trainer", password.replace("%23", "#")).auth_flow(httpx.Request("GET", "http://x"))
                    header = next(want).headers["Authorization"]
                    got = next(engine._auth.auth_flow(httpx.Request("GET", "http://x"))).headers["Authorization"]
                    texts.extend((label, t) for t in _texts(engine))
                    case(label, served == [] and got == header and engine.url == server.url, f"url {engine.url!r}, auth differs: {got != header}")
                    engine.close()
                except Exception as exc:  # noqa: BLE001
                    texts.extend((label, t) for t in _texts(exc))
                    case(label, False, f"{type(exc).__name__}")
            label = "URL with a password and an invalid port"
            try:
                parse_engine_spec(f"vllm:http://trainer:pa#ss{SECRET}@127.0.0.1:port")
                case(label, False, "accepted")
            except ConfigError as exc:
                texts.extend((label, t) for t in _texts(exc))
                case(label, True)
            except Exception as exc:  # noqa: BLE001
                texts.extend((label, t) for t in _texts(exc))
                case(label, False, f"{type(exc).__name__} instead of ConfigError")
        texts.append(("DEBUG log", log.getvalue()))
    leaks = sorted({label for label, text in texts for s in secrets if s in text or s.strip() in text})
    tried += 1
    if leaks:
        violations.append(f"a secret shows in: {leaks}")
    else:
        handled += 1
    return {"tried": tried, "handled": handled, "violations": violations}

