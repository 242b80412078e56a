"""VLLMEngine against real vLLM servers started with other flags (two short-lived servers).

* ``locked``: no ``--enable-lora``, ``--api-key``, runtime updating and dev mode on, and a
  stand-in worker extension: LoRA-disabled refusals, authentication, the extension probe.
* ``static``: LoRA on but runtime updating and dev mode off: the routes are missing and the
  limits come from the constructor.

Each server lives for one test class, so at most one of them runs at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorasync.engines.vllm import VLLMEngine
from lorasync.errors import AuthenticationError, LoraNotEnabledError, RuntimeLoraDisabledError
from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model, make_tiny_model
from lorasync.testing.vllm_server import VLLMServer

pytestmark = pytest.mark.vllm

API_KEY = "sk-test-5f0c2d9e7b"
SMALL = ("--max-num-seqs", "4", "--max-model-len", "256")  # two cores: keep extra servers light


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(make_peft_model(make_tiny_model(), r=8, seed=1)).save(tmp_path_factory.mktemp("adapter") / "a")


@pytest.fixture(scope="class")
def locked(vllm_python: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    server = VLLMServer(
        tiny_model_dir,
        python=vllm_python,
        enable_lora=False,
        api_key=API_KEY,
        served_model_name="tiny-base",
        extra_args=(*SMALL, "--worker-extension-cls", "tests.engines.vllm_probe_ext.ProbeExtension"),
        log_path=tmp_path_factory.mktemp("vllm-logs") / "vllm-locked.log",
    )
    with server:
        yield server


@pytest.fixture(scope="class")
def static(vllm_python: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    server = VLLMServer(
        tiny_model_dir,
        python=vllm_python,
        runtime_lora=False,
        dev_mode=False,
        max_loras=1,
        max_cpu_loras=1,
        served_model_name="tiny-base",
        extra_args=SMALL,
        log_path=tmp_path_factory.mktemp("vllm-logs") / "vllm-static.log",
    )
    with server:
        yield server


@pytest.fixture(autouse=True)
def no_key_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


class TestWithoutLoraWithApiKey:
    """Server ``locked``: no --enable-lora, --api-key, a stand-in worker extension."""

    def test_lora_disabled_load_maps_to_lora_not_enabled(self, locked: VLLMServer, adapter_dir: Path) -> None:
        with VLLMEngine(locked.url, api_key=API_KEY) as engine:
            with pytest.raises(LoraNotEnabledError, match="--enable-lora") as info:
                engine.load_adapter("policy@v1", adapter_dir)
            assert (info.value.status, info.value.adapter) == (500, "policy@v1")
            assert engine.list_adapters() == []

    def test_capabilities_report_lora_off_and_the_worker_extension(self, locked: VLLMServer) -> None:
        with VLLMEngine(locked.url, api_key=API_KEY) as engine:
            caps = engine.capabilities()
        assert (caps.lora, caps.runtime_lora, caps.max_rank) == (False, True, None)
        assert (caps.tensor_load, caps.weight_update) == (True, True)  # the probe answered on every worker

    def test_api_key_from_env_is_used(self, locked: VLLMServer, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("VLLM_API_KEY", API_KEY)
        with VLLMEngine(locked.url) as engine:
            assert engine.list_adapters() == []

    @pytest.mark.parametrize("key", [None, "wrong-key"])
    def test_missing_or_wrong_key_maps_to_authentication(
        self, locked: VLLMServer, adapter_dir: Path, key: str | None
    ) -> None:
        with VLLMEngine(locked.url, api_key=key) as engine:
            with pytest.raises(AuthenticationError, match="VLLM_API_KEY") as info:
                engine.list_adapters()
            assert info.value.status == 401
            with pytest.raises(AuthenticationError):
                engine.load_adapter("policy@v1", adapter_dir)
            with pytest.raises(AuthenticationError):
                engine.capabilities()

    def test_key_never_shown(self, locked: VLLMServer, adapter_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
        caplog.set_level(logging.DEBUG)  # httpx/httpcore log every request at DEBUG
        for name in ("httpx", "httpcore", "lorasync"):  # whatever level an earlier CLI run in this process set
            caplog.set_level(logging.DEBUG, logger=name)
        engine = VLLMEngine(locked.url, api_key=API_KEY)
        errors: list[Exception] = []
        try:
            engine.capabilities()
            engine.list_adapters()
            try:
                engine.load_adapter("policy@v1", adapter_dir)
            except LoraNotEnabledError as exc:
                errors.append(exc)
        finally:
            engine.close()
        assert caplog.records, "expected DEBUG records from httpx"
        shown = [caplog.text, repr(engine), repr(locked), " ".join(locked.command()), *map(str, errors)]
        shown.append(locked.log_text())  # vLLM prints its arguments at startup (it masks api_key itself)
        shown += [repr(e.context) for e in errors]
        assert errors and all(API_KEY not in text for text in shown)
        assert "***" in repr(engine)


class TestWithoutRuntimeUpdating:
    """Server ``static``: LoRA on; runtime updating and dev mode off."""

    def test_runtime_updating_off_maps_to_runtime_disabled(self, static: VLLMServer, adapter_dir: Path) -> None:
        with VLLMEngine(static.url) as engine:
            with pytest.raises(RuntimeLoraDisabledError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=1") as info:
                engine.load_adapter("policy@v1", adapter_dir)
            assert info.value.status == 404
            with pytest.raises(RuntimeLoraDisabledError):
                engine.unload_adapter("policy@v1")
            assert engine.list_adapters() == []

    def test_a_publish_says_which_variable_to_set(self, static: VLLMServer, adapter_dir: Path, tmp_path: Path) -> None:
        # What a user meets first (issue 37): a publish, not a load. It said "no transport can reach
        # vllm ... disk: engine cannot load LoRA adapters at runtime", naming no variable.
        from lorasync import Adapter, Publisher

        with Publisher([f"vllm:{static.url}"], name="nort", root=tmp_path) as pub:
            report = pub.publish(Adapter.load(adapter_dir), version=1)
        error = report.results[0].error
        assert isinstance(error, RuntimeLoraDisabledError)  # what docs/engines/vllm.md promises
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in str(error) and "--api-server-count 1" in str(error)
        assert "base=" in str(error)  # the merged fallback, the other way out

    def test_capabilities_without_dev_mode_fall_back_to_options(self, static: VLLMServer) -> None:
        with VLLMEngine(static.url) as engine:
            caps = engine.capabilities()
        assert (caps.runtime_lora, caps.max_rank, caps.max_loras, caps.tensor_load) == (False, None, None, False)
        assert any("VLLM_SERVER_DEV_MODE" in note for note in caps.notes)
        with VLLMEngine(static.url, max_rank=16, max_loras=1) as engine:
            caps = engine.capabilities()
        assert (caps.max_rank, caps.max_loras) == (16, 1)

    def test_greedy_on_the_base_model_without_lora_routes(self, static: VLLMServer, tiny_model_dir: Path) -> None:
        import torch

        base = make_tiny_model()
        prompt = [5, 6, 7, 8]
        with torch.no_grad():
            want = base.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 4:]
        with VLLMEngine(static.url) as engine:
            tokens, logprobs = engine.greedy(None, prompt, 6)
        assert tokens == want.tolist() and len(logprobs) == 6
