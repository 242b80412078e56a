"""Engine protocol drift: the clients read the engine's version and refuse a major version
lorasync has no table for, with a typed error that says what to do; a newer release of a known
major version is served with a warning and a capabilities note."""

from __future__ import annotations

import warnings

import httpx
import pytest

from lorasync import RetryPolicy
from lorasync.engines._versions import ALLOW_ENV, KNOWN, check_engine_version, parse_version
from lorasync.engines.vllm import VLLMEngine
from lorasync.errors import EngineProtocolError, LoraSyncWarning, UnsupportedEngineVersionError


def _vllm(version: str | None) -> VLLMEngine:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/load_lora_adapter":
            return httpx.Response(405, json={"detail": "Method Not Allowed"})
        if request.url.path == "/version" and version is not None:
            return httpx.Response(200, json={"version": version})
        return httpx.Response(404, json={"detail": "Not Found"})

    transport = httpx.MockTransport(handler)
    return VLLMEngine("http://vllm.test:8000", retries=RetryPolicy(attempts=1), transport=transport, async_transport=transport)


def test_unknown_major_version_is_refused_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(UnsupportedEngineVersionError) as info:
        _vllm("1.0.0").capabilities()
    message = str(info.value)
    assert "vllm 1.0.0 at http://vllm.test:8000" in message and "0.x" in message
    assert "Upgrade lorasync" in message and ALLOW_ENV in message
    assert isinstance(info.value, EngineProtocolError) and info.value.version == "1.0.0"


def test_opt_in_tries_an_unknown_major(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOW_ENV, "1")
    caps = _vllm("1.0.0").capabilities()
    assert any(ALLOW_ENV in note for note in caps.notes)


def test_newer_minor_warns_and_notes() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        caps = _vllm("0.99.0").capabilities()
    assert any("newer than the newest release lorasync was tested with (0.32.0)" in n for n in caps.notes)
    assert any(issubclass(w.category, LoraSyncWarning) for w in seen)


def test_tested_and_unreported_versions_pass() -> None:
    assert not [n for n in _vllm("0.32.0").capabilities().notes if "newer" in n or "major" in n]
    assert any("did not report its version" in n for n in _vllm(None).capabilities().notes)


def test_sglang_table_and_parsing() -> None:
    assert parse_version("v0.5.23.post1") == (0, 5, 23)
    assert parse_version("not a version") is None
    assert check_engine_version("sglang", "0.5.23") == []
    assert "older than 0.5.4" in check_engine_version("sglang", "0.5.2")[0]
    with pytest.raises(UnsupportedEngineVersionError):
        check_engine_version("sglang", "1.2.0", url="http://sglang.test:30000")
    assert check_engine_version("peft", "9.9") == []  # only engines with a table are checked
    assert KNOWN["vllm"].tested == (0, 32, 0) and KNOWN["sglang"].tested == (0, 5, 23)
