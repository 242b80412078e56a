"""A data-parallel vLLM behind one URL (``--data-parallel-size 2 --api-server-count 1``, the only
data-parallel form that takes runtime LoRA loads: several API servers refuse them at start) is
one engine to lorasync, and every engine core serves what lorasync publishes.

vLLM's one API server sends ``add_lora`` and ``collective_rpc`` to every engine core, so one
publish reaches both (docs/engines/fleets.md). Checked as a user would: after each publish (the
IPC one-trip load, then disk, then IPC again retiring the first), completions on fresh
connections until vLLM's own per-engine counter shows both engine cores answered, every one
exact against PEFT's greedy tokens.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from lorasync import Publisher
from lorasync.engines import connect
from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model, make_tiny_model
from lorasync.testing.vllm_server import VLLMServer

from tests.support.greedy import peft_greedy as reference

pytestmark = pytest.mark.vllm

PROMPTS = ([5, 17, 99, 230, 41], [300, 12, 7], [64, 65, 66, 67, 68, 69])


def answered_per_engine(server: VLLMServer) -> dict[str, float]:
    """Requests each engine core finished, from vLLM's own counter (its ``engine`` label)."""
    text = httpx.get(f"{server.url}/metrics", timeout=60).text
    out: dict[str, float] = {}
    for labels, value in re.findall(r"^vllm:request_success_total\{([^}]*)\} ([0-9.e+]+)$", text, re.M):
        engine = re.search(r'engine="([^"]+)"', labels)
        if engine:
            out[engine.group(1)] = out.get(engine.group(1), 0.0) + float(value)
    return out


def every_engine_serves(server: VLLMServer, model: str, expected: list[list[int]]) -> None:
    """Fresh-connection completions until both engine cores answered some; every one exact."""
    before = answered_per_engine(server)
    for k in range(24):
        prompt = PROMPTS[k % len(PROMPTS)]
        body = {"model": model, "prompt": list(prompt), "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        with httpx.Client(timeout=120) as client:  # a new connection each time, as many users' requests are
            response = client.post(f"{server.url}/v1/completions", json=body)
        assert response.status_code == 200, (model, response.status_code, response.text[:300])
        assert response.json()["choices"][0]["token_ids"] == expected[k % len(PROMPTS)], (model, prompt, k)
        after = answered_per_engine(server)
        if k >= 11 and len(after) >= 2 and all(after[e] > before.get(e, 0.0) for e in after):
            return
    raise AssertionError(f"{model}: not every engine core answered: before {before}, after {answered_per_engine(server)}")


def test_every_engine_core_serves_each_published_version(vllm_dp_server: VLLMServer, tmp_path: Path) -> None:
    with connect("vllm", vllm_dp_server.url) as engine:
        published: list[str] = []
        pubs = {t: Publisher([engine], name=f"dp-{t}", root=tmp_path / t, keep=1, transport=t) for t in ("ipc", "disk")}
        try:
            for step, transport in enumerate(("ipc", "disk", "ipc")):
                model = make_peft_model(make_tiny_model(), r=8, seed=20 + step)
                report = pubs[transport].publish(export(model), version=step + 1).raise_for_errors()
                assert [r.transport for r in report.results] == [transport]
                every_engine_serves(vllm_dp_server, report.served_name, [reference(model, list(p)) for p in PROMPTS])
                report.settled()
                published.append(report.served_name)
            # keep=1: the IPC publisher's first version was retired when its second served.
            listed = engine.list_adapters()
            assert published[0] not in listed and published[2] in listed and published[1] in listed, listed
        finally:
            for pub in pubs.values():
                pub.close()
            for name in engine.list_adapters():
                engine.unload_adapter(name)
