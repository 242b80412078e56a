"""An HTTP engine's URL is checked when the client is made: httpx accepts a port out of range or
a URL with no scheme, and the first request then failed with an error that named neither
(``lorasync publish --engine vllm:http://127.0.0.1:99999`` printed an ExceptionGroup)."""

from __future__ import annotations

import pytest

from lorasync.engines.sglang import SGLangEngine
from lorasync.engines.vllm import VLLMEngine
from lorasync.errors import ConfigError


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://127.0.0.1:99999", "port 99999, outside 1-65535"),
        ("http://127.0.0.1:0", "port 0, outside 1-65535"),
        ("localhost:8000", "needs a scheme and a host"),
        ("127.0.0.1:8000", "needs a scheme and a host"),
        ("ftp://127.0.0.1:21", "needs a scheme and a host"),
        ("http://:8000", "needs a scheme and a host"),
        ("http://user:hunter2@127.0.0.1:70000", "port 70000"),
    ],
)
@pytest.mark.parametrize("engine", [VLLMEngine, SGLangEngine])
def test_a_url_no_request_could_use_is_refused_when_the_client_is_made(engine, url, says):
    with pytest.raises(ConfigError, match=says) as caught:
        engine(url)
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "https://vllm.internal", "http://[::1]:65535/", "http://localhost:1"])
def test_good_urls_are_kept(url):
    assert VLLMEngine(url).url == url.rstrip("/")


def test_the_cli_says_which_port_is_wrong(tmp_path, capsys):
    from lorasync.cli import main
    from lorasync import Adapter
    from lorasync.testing import tiny_llama_adapter

    folder = tmp_path / "adapter"
    Adapter.save(tiny_llama_adapter(), folder)
    code = main(["publish", str(folder), "--engine", "vllm:http://127.0.0.1:99999", "--name", "a", "--version", "1"])
    assert code == 2
    assert "port 99999, outside 1-65535" in capsys.readouterr().err
