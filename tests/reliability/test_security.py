"""No unpickling of untrusted bytes anywhere in lorasync, and no API key in logs, reprs, errors
or reports."""

from __future__ import annotations

import json
import logging
import pickle
import re
from pathlib import Path

import lorasync
from lorasync import Publisher
from lorasync.errors import AuthenticationError
from lorasync.testing.vllm_server import VLLMServer

from ._faultserver import FaultServer
from ._harness import client, tiny_adapter

PACKAGE = Path(lorasync.__file__).resolve().parent
SECRET = "sk-lorasync-7d3f9a1c-do-not-log"

# Modules that may import pickle, and why. The SGLang client *sends* pickles SGLang expects on its
# tensor routes (SGLang unpickles them with an allowlist); the export CLI names
# pickle.UnpicklingError to report a bad .pt it read with torch.load(weights_only=True).
PICKLE_IMPORTS = {"engines/sglang/protocol.py", "cli/export.py"}


def _calls(source: str, name: str) -> list[str]:
    """The full text of every ``name(...)`` call (balanced parentheses, across lines)."""
    out = []
    for match in re.finditer(rf"(?<![\w.]){re.escape(name)}\(", source):
        depth, i = 0, match.end() - 1
        while i < len(source):
            depth += {"(": 1, ")": -1}.get(source[i], 0)
            if depth == 0:
                break
            i += 1
        out.append(source[match.start() : i + 1])
    return out


def test_no_untrusted_deserialization_in_the_package():
    sources = {p.relative_to(PACKAGE).as_posix(): p.read_text() for p in PACKAGE.rglob("*.py")}
    assert len(sources) > 40
    findings = []
    for path, text in sources.items():
        code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())  # comments may name them
        for pattern in (r"\bpickle\.loads?\(", r"\bUnpickler\b", r"\bmarshal\.loads?\(", r"\bdill\.", r"\bcloudpickle\.",
                        r"allow_pickle\s*=\s*True", r"\byaml\.(unsafe_)?load\(", r"(?<![\w.])(eval|exec)\("):  # fmt: skip
            findings += [f"{path}: {m.group(0)}" for m in re.finditer(pattern, code)]
        for call in _calls(code, "torch.load"):
            if not re.search(r"weights_only\s*=\s*True", call):
                findings.append(f"{path}: {call}")
        if re.search(r"^\s*(import pickle|from pickle import)", code, re.M) and path not in PICKLE_IMPORTS:
            findings.append(f"{path}: imports pickle")
    assert findings == []
    # The only pickle use is a Pickler that *writes* (what SGLang's tensor routes read).
    sglang = sources["engines/sglang/protocol.py"]
    assert "pickle.Pickler(" in sglang and "pickle.load" not in sglang


def test_the_grep_finds_what_it_looks_for():
    bad = "x = torch.load(path)\ny = torch.load(str(p), map_location='cpu')\nz = torch.load(p, weights_only=True)\n"
    assert [c for c in _calls(bad, "torch.load") if "weights_only=True" not in c] == ["torch.load(path)", "torch.load(str(p), map_location='cpu')"]


def test_api_keys_never_reach_logs_reprs_errors_or_reports(caplog, tmp_path):
    caplog.set_level(logging.DEBUG)  # every logger: lorasync, httpx, httpcore, asyncio
    texts: list[str] = []
    for protocol in ("vllm", "sglang"):
        with FaultServer(protocol, api_key=SECRET) as server:
            good = client(protocol, server.url, api_key=SECRET)
            report = Publisher([good], name="k", root=tmp_path / protocol, transport="disk").publish(tiny_adapter(1), version=1)
            assert report.ok, report
            assert SECRET in server.stats["keys_seen"]  # it was sent, so a leak would be real
            wrong = SECRET[::-1]
            bad = client(protocol, server.url, api_key=wrong)
            in_url = client(protocol, server.url.replace("http://", f"http://trainer:{SECRET}@"))
            # One publisher per client: two clients of one server in one publisher are refused.
            fails = [Publisher([c], name="k", root=tmp_path / protocol, transport="disk").publish(tiny_adapter(2), version=2) for c in (bad, in_url)]
            errors = [r.error for failed in fails for r in failed.results]
            assert len(errors) == 2 and all(isinstance(e, AuthenticationError) for e in errors), fails
            for obj in (good, bad, in_url, report, *fails, *errors):
                texts += [repr(obj), str(obj)]
            texts += [json.dumps(report.to_dict(), default=str)] + [json.dumps(f.to_dict(), default=str) for f in fails]
            texts += [repr(e.context) for e in errors] + [str(pickle.loads(pickle.dumps(e))) for e in errors]
            for engine in (good, bad, in_url):
                engine.close()
    server_cmd = VLLMServer("/models/x", api_key=SECRET, python="/nonexistent/python")
    texts += [repr(server_cmd), " ".join(server_cmd.command())]
    texts.append(caplog.text)
    assert caplog.text  # the HTTP stack did log at DEBUG
    for secret in (SECRET, SECRET[::-1]):
        assert not [t for t in texts if secret in t]
