"""Real vLLM: the engine dies (SIGKILL, whole process group) after it loaded a version and before
the publisher verified it. The publish is reported failed and keeps the version's files; once the
engine is back, the next publish of that same version loads it again and it serves the trainer's
exact tokens. Uses its own server (two starts in all), not the session fixture."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from lorasync import Probe, Publisher, RetryPolicy
from lorasync.engines.vllm import VLLMEngine
from lorasync.errors import EngineUnavailableError
from lorasync.exporters.fsdp import export

from ._figures import record

pytestmark = pytest.mark.vllm

PROMPT = [5, 17, 99, 230, 41]


class KillBeforeVerify(VLLMEngine):
    """A vLLM client whose first probe request is preceded by the engine's death."""

    def __init__(self, url: str, kill: object, **kwargs: object) -> None:
        super().__init__(url, **kwargs)  # type: ignore[arg-type]
        self._kill = kill

    async def agreedy(self, name, prompt_ids, max_tokens):  # type: ignore[no-untyped-def]
        if self._kill is not None:
            kill, self._kill = self._kill, None
            kill()  # type: ignore[operator]
        return await super().agreedy(name, prompt_ids, max_tokens)


def _reference(model, prompt, n=6):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_engine_killed_between_load_and_verify_recovers_on_next_publish(vllm_python: Path, tiny_model_dir: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    from lorasync.testing import make_peft_model
    from lorasync.testing.vllm_server import VLLMServer

    model = make_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), seed=77)
    adapter = export(model)
    probe = Probe.from_model(model, PROMPT, max_tokens=4, atol=1e-3)
    server = VLLMServer(tiny_model_dir, python=vllm_python, served_model_name="tiny-base", log_path=tmp_path / "vllm.log")

    def kill() -> None:
        os.killpg(server.pid, signal.SIGKILL)  # the engine and its workers, no goodbye
        server.stop()  # reap

    server.start()
    try:
        engine = KillBeforeVerify(server.url, kill, timeout=60, retries=RetryPolicy(attempts=3, backoff=0.2))
        pub = Publisher([engine], name="pol", keep=1, transport="disk", root=tmp_path / "store")
        report = pub.publish(adapter, version=1, verify=probe)
        result = report.results[0]
        assert result.status == "failed" and isinstance(result.error, EngineUnavailableError), report
        assert not server.alive()
        assert (pub.store.path_for("pol", 1) / "adapter_model.safetensors").is_file()  # kept: engine state unknown

        start = time.monotonic()
        server.start()  # same port, empty engine
        restart_s = time.monotonic() - start
        again = pub.publish(adapter, version=1, verify=probe)
        assert again.ok, again
        assert again.results[0].status == "loaded" and "verified" in again.results[0].reason
        assert engine.list_adapters() == ["pol@v1"]
        assert engine.greedy("pol@v1", PROMPT, 6)[0] == _reference(model, PROMPT)
        record(vllm_restart=f"yes ({restart_s:.0f}s restart)")
        engine.close()
    finally:
        server.stop()
