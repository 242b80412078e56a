"""Only a verified version counts as served, on the real vLLM CPU server (issue 33 items 3 and 4).

The probe's generate call times out (the client's real HTTP deadline, set tiny for that one call,
as when the server is busy with rollouts): the publish fails, the previous version is what the
server serves afterwards (read back by generating through it), the new version is not listed,
and the same publish retried is verified again, never reported ``unchanged``.
"""

from __future__ import annotations

import pytest

from lorasync import Probe, Publisher
from lorasync.engines.vllm import VLLMEngine
from lorasync.errors import EngineTimeoutError, EngineUnavailableError, VerificationError
from lorasync.exporters.fsdp import export

from .conftest import PROMPTS, reference

pytestmark = pytest.mark.vllm


class BusyProbeClient(VLLMEngine):
    """The real vLLM client; while ``busy``, the probe's generate gets a deadline no answer meets."""

    busy = False

    async def agreedy(self, name, prompt_ids, max_tokens):
        if not self.busy:
            return await super().agreedy(name, prompt_ids, max_tokens)
        timeout, self.timeout = self.timeout, 0.001
        try:
            return await super().agreedy(name, prompt_ids, max_tokens)
        finally:
            self.timeout = timeout


@pytest.fixture
def vllm(vllm_server):
    engine = BusyProbeClient(vllm_server.url, timeout=120, retries=0)
    yield engine
    engine.close()


def _probe(model) -> Probe:
    return Probe(prompt_ids=PROMPTS[0], expected_ids=reference(model, PROMPTS[0], n=4))


def _served(vllm, name: str | None) -> list[list[int]]:
    return [vllm.greedy(name, list(p), 6)[0] for p in PROMPTS]


@pytest.mark.parametrize("transport", ["disk", "ipc"])
def test_a_probe_that_times_out_leaves_the_previous_version_serving_on_vllm(transport, vllm, trainer, tmp_path):
    name = f"vfy-{transport}"
    pub = Publisher([vllm], name=name, transport=transport, root=tmp_path, keep=1, grace=0.0)
    try:
        v1, v2 = trainer(seed=51), trainer(seed=52)
        assert pub.publish(export(v1), version=1, verify=_probe(v1)).ok
        vllm.busy = True
        report = pub.publish(export(v2), version=2, verify=_probe(v2))
        vllm.busy = False
        assert [n for n in vllm.list_adapters() if n.startswith(name)] == [f"{name}@v1"], "v2 serves, unverified"
        assert _served(vllm, f"{name}@v1") == [reference(v1, p) for p in PROMPTS]
        error = report.results[0].error
        assert isinstance(error, VerificationError), report
        assert isinstance(error.__cause__, (EngineTimeoutError, EngineUnavailableError)), repr(error.__cause__)
        # Item 4: the same publish again is verified again (a probe the server does not reproduce fails it) ...
        wrong = Probe(prompt_ids=PROMPTS[0], expected_ids=[t ^ 1 for t in reference(v2, PROMPTS[0], n=4)])
        again = pub.publish(export(v2), version=2, verify=wrong).results[0]
        assert again.status == "failed" and isinstance(again.error, VerificationError), f"{again.status}: {again.reason}"
        # ... and loads, verified, with one it does.
        verified = pub.publish(export(v2), version=2, verify=_probe(v2))
        assert verified.ok and verified.results[0].status == "loaded", verified
        assert _served(vllm, f"{name}@v2") == [reference(v2, p) for p in PROMPTS]
        verified.settled(60)
        assert [n for n in vllm.list_adapters() if n.startswith(name)] == [f"{name}@v2"]
    finally:
        pub.close()
        for served in vllm.list_adapters():
            if served.startswith(name):
                vllm.unload_adapter(served)


def test_a_merged_publish_whose_probe_times_out_puts_the_previous_merge_back_on_vllm(vllm, trainer, tiny_model_dir, tmp_path):
    pub = Publisher([vllm], name="vfy-merged", transport="merged", root=tmp_path, base=tiny_model_dir, bucket_bytes=1 << 20)
    try:
        v1, v2 = trainer(seed=53, targets=("q_proj", "down_proj")), trainer(seed=54, targets=("q_proj", "down_proj"))
        assert pub.publish(export(v1), version=1, verify=_probe(v1)).ok
        vllm.busy = True
        report = pub.publish(export(v2), version=2, verify=_probe(v2))
        vllm.busy = False
        assert _served(vllm, None) == [reference(v1, p) for p in PROMPTS], "the base keeps v2's unverified merge"
        assert isinstance(report.results[0].error, VerificationError), report
        assert pub.publish(export(v2), version=2, verify=_probe(v2)).results[0].status == "loaded"
        assert _served(vllm, None) == [reference(v2, p) for p in PROMPTS]
    finally:
        pub.restore_base()
        pub.close()
