"""publish_adapter against the real vLLM CPU server: every transport serves exactly the trained
weights through the OpenAI API, versions switch, retention holds, and a dead engine is reported
without disturbing the others."""

import os
import time

import pytest

from lorasync import Probe, Publisher
from lorasync.engines import connect
from lorasync.errors import EngineUnavailableError
from lorasync.exporters.fsdp import export

from .conftest import PROMPTS, reference

pytestmark = pytest.mark.vllm


@pytest.fixture
def vllm(vllm_server):
    engine = connect("vllm", vllm_server.url, timeout=120)
    yield engine
    engine.close()


def served_tokens(engine, served, prompt, n=6):
    return engine.greedy(served, list(prompt), n)


@pytest.mark.parametrize("transport", ["disk", "ipc"])
def test_adapter_transports_serve_trained_weights(transport, vllm, trainer, tmp_path):
    name = f"pol-{transport}"
    pub = Publisher([vllm], name=name, transport=transport, root=tmp_path, keep=1)
    seen = {}
    for version, seed in ((1, 21), (2, 22)):
        model = trainer(seed=seed)
        probe = Probe.from_model(model, PROMPTS[0], max_tokens=4, atol=1e-3)
        report = pub.publish(export(model), version=version, verify=probe)
        assert report.ok, report
        assert report.results[0].transport == transport
        for prompt in PROMPTS:
            tokens, logprobs = served_tokens(vllm, report.served_name, prompt)
            assert tokens == reference(model, prompt)
            assert Probe.from_model(model, prompt, max_tokens=6, atol=1e-3).mismatch(tokens, logprobs) is None
        seen[version] = [served_tokens(vllm, report.served_name, p)[0] for p in PROMPTS]
    assert seen[1] != seen[2]
    # Retirement runs after publish returned (Retention.background): wait for it, as a user who
    # looks at the engine right after a publish does, and check it retired v1 rather than
    # deferring it (no request was in flight on v1).
    report.settled()
    assert report.results[0].retired == [f"{name}@v1"] and not report.results[0].deferred, report
    # keep=1: only the newest version is served; its files exist, the old one's are gone.
    assert [n for n in vllm.list_adapters() if n.startswith(name)] == [f"{name}@v2"]
    if transport == "disk":
        # vLLM may re-read an unloaded version for a request it admitted: its files outlive the
        # unload by the grace period, then the next collection removes them.
        time.sleep(pub.retention.grace)
        pub.collect()
        assert pub.store.versions(name) == [2]
    else:
        assert pub.store.versions(name) == []  # ipc writes no files
    for served in vllm.list_adapters():
        if served.startswith(name):
            vllm.unload_adapter(served)


def test_merged_transport_folds_from_pristine_base(vllm, trainer, tiny_model_dir, tmp_path):
    pub = Publisher([vllm], name="merged", transport="merged", root=tmp_path, base=tiny_model_dir, bucket_bytes=1 << 20)
    try:
        for version, seed, targets in ((1, 31, ("q_proj", "down_proj")), (2, 32, ("q_proj", "k_proj"))):
            model = trainer(seed=seed, targets=targets)
            report = pub.publish(export(model), version=version)
            assert report.ok, report
            assert report.results[0].transport == "merged"
            for prompt in PROMPTS:
                assert served_tokens(vllm, None, prompt)[0] == reference(model, prompt)
    finally:
        pub.restore_base()
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert [served_tokens(vllm, None, p)[0] for p in PROMPTS] == [reference(base, p) for p in PROMPTS]


def test_dead_engine_is_reported_and_others_serve(vllm, peft_engine, trainer, tmp_path, dead_url):
    from lorasync.engines.vllm import VLLMEngine

    dead = VLLMEngine(dead_url, retries=2, timeout=5)
    model = trainer(seed=41)
    report = Publisher([vllm, dead, peft_engine], name="fanout", root=tmp_path, keep=1).publish(export(model), version=1)
    assert [r.status for r in report.results] == ["loaded", "failed", "loaded"]
    err = report.results[1].error
    assert isinstance(err, EngineUnavailableError) and err.attempts == 3 and dead.url in str(err)
    for engine in (vllm, peft_engine):
        assert served_tokens(engine, "fanout@v1", PROMPTS[0])[0] == reference(model, PROMPTS[0])
    vllm.unload_adapter("fanout@v1")
