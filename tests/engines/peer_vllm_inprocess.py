"""The in-process vLLM engine against a real ``vllm.LLM`` and ``AsyncLLM`` (vLLM 0.32 CPU build).

Runs in the vLLM engine venv, not the library's: ``tests/engines/test_vllm_inprocess.py`` writes
the adapters and PEFT's reference tokens (PEFT in the library venv is the numerical reference)
into a JSON file named by ``LORASYNC_INPROC_DATA`` and runs this module there with pytest
(``-o python_files=peer_*.py``; the library venv never collects it). ``LORASYNC_INPROC_MODE``
picks ``llm`` or ``async``. One engine per module run: the LLM takes about a minute to start on
the CPU build.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lorasync import Adapter, Probe, Publisher
from lorasync.engines import connect
from lorasync.engines.vllm._protocol import WORKER_EXTENSION
from lorasync.engines.vllm.inprocess import VLLMInProcessEngine
from lorasync.errors import (
    AdapterAlreadyLoadedError,
    AdapterNotFoundError,
    ConfigError,
    EngineUnavailableError,
    LoraNotEnabledError,
    RankTooLargeError,
)
from lorasync.testing import EngineConformance
from tests.engines._inproc_host import connect_to, hosted

DATA: dict[str, Any] = json.loads(Path(os.environ.get("LORASYNC_INPROC_DATA", "/nonexistent")).read_text()) if os.environ.get("LORASYNC_INPROC_DATA") else {}
MODE = os.environ.get("LORASYNC_INPROC_MODE", "llm")
ARGS = dict(
    enable_lora=True,
    max_lora_rank=16,
    max_loras=2,
    max_cpu_loras=4,
    dtype="float32",
    enforce_eager=True,
    max_model_len=256,
    max_num_seqs=4,
    worker_extension_cls=WORKER_EXTENSION,
)


@pytest.fixture(scope="module")
def host() -> Iterator[Any]:
    yield from hosted(MODE, DATA["model_dir"], ARGS)


@pytest.fixture(scope="module")
def engine(host: Any) -> VLLMInProcessEngine:
    return connect_to(MODE, host)  # type: ignore[no-any-return]


def generate(host: Any, engine: VLLMInProcessEngine, served: str, prompt: list[int]) -> list[int]:
    """Greedy tokens the way a rollout asks for them: llm.generate with engine.lora_request."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=DATA["new_tokens"], ignore_eos=True)
    request = engine.lora_request(served)
    if MODE == "async":

        async def one() -> list[int]:
            final = None
            async for out in host.llm.generate({"prompt_token_ids": prompt}, params, request_id=f"t-{served}-{prompt[0]}", lora_request=request):
                final = out
            return list(final.outputs[0].token_ids)

        return host.run(one())
    outputs = host.generate([{"prompt_token_ids": prompt}], params, lora_request=request, use_tqdm=False)
    return list(outputs[0].outputs[0].token_ids)


def loaded_ids(host: Any) -> set[int]:
    if MODE == "async":
        return set(host.run(host.llm.list_loras()))
    return set(host.llm_engine.list_loras())


# -- the acceptance scenario ------------------------------------------------------------------------


def test_capabilities_come_from_the_engine_config(engine: VLLMInProcessEngine) -> None:
    caps = engine.capabilities()
    assert (caps.engine, caps.lora, caps.runtime_lora, caps.in_process, caps.same_host) == ("vllm-inprocess", True, True, True, True)
    assert (caps.max_rank, caps.max_loras, caps.tensor_load) == (16, 4, True)
    assert "dtype torch.float32" in caps.notes and any(n.startswith("vllm 0.32") for n in caps.notes)


def test_three_versions_keep_two_each_serving_peft_tokens(host: Any, engine: VLLMInProcessEngine, tmp_path: Path) -> None:
    publisher = Publisher(engine, name="policy", keep=2, root=tmp_path / "store")
    served: list[str] = []
    for version, (adapter_dir, expected) in enumerate(zip(DATA["adapters"], DATA["expected"]), start=1):
        probe = Probe(prompt_ids=tuple(DATA["prompts"][0]), expected_ids=tuple(expected[0]))
        if MODE == "async" and version == 2:
            # On the AsyncLLM's own loop, as an async trainer would publish.
            report = host.run(publisher.apublish(Adapter.load(adapter_dir), version=version, verify=probe))
        else:
            report = publisher.publish(Adapter.load(adapter_dir), version=version, verify=probe)
        report.raise_for_errors()
        (result,) = report.results
        assert (result.status, result.transport, report.served_name) == ("loaded", "ipc", f"policy@v{version}")
        served.append(report.served_name)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and MODE == "llm":
            # The worker runs in this process: tensors are handed over directly, never through
            # shared memory, and the worker keeps its own copy (the caller's tensors may change).
            assert engine._same_process()
        for prompt, want in zip(DATA["prompts"], expected):
            assert generate(host, engine, report.served_name, prompt) == want, (version, prompt)
    # Only the last two stay loaded, in lorasync's names and in vLLM's own adapter ids (once the
    # last publish's retirement, which runs after it returned, is done).
    report.settled()
    assert engine.list_adapters() == served[1:]
    assert loaded_ids(host) == {engine.lora_request(s).lora_int_id for s in served[1:]}
    with pytest.raises(AdapterNotFoundError):
        engine.lora_request(served[0])
    publisher.close()
    for name in engine.list_adapters():
        engine.unload_adapter(name)


def test_two_engine_objects_over_one_llm_serve_their_own_weights(host: Any, engine: VLLMInProcessEngine, tmp_path: Path) -> None:
    other = connect("vllm-inprocess", llm=host.llm, loop=host.loop) if MODE == "async" else connect("vllm-inprocess", llm=host)
    with Publisher(engine, name="first", root=tmp_path / "a") as one, Publisher(other, name="second", root=tmp_path / "b") as two:
        first = one.publish(Adapter.load(DATA["adapters"][0]), version=1).raise_for_errors().served_name
        second = two.publish(Adapter.load(DATA["adapters"][1]), version=1).raise_for_errors().served_name
        assert engine.lora_request(first).lora_int_id != other.lora_request(second).lora_int_id
        prompt = DATA["prompts"][0]
        assert generate(host, other, second, prompt) == DATA["expected"][1][0]
        assert generate(host, engine, first, prompt) == DATA["expected"][0][0]
    engine.unload_adapter(first)
    other.unload_adapter(second)


def test_disk_fallback_serves_the_same_tokens(host: Any, engine: VLLMInProcessEngine, tmp_path: Path) -> None:
    with Publisher(engine, name="disked", transport="disk", root=tmp_path / "store") as publisher:
        report = publisher.publish(Adapter.load(DATA["adapters"][0]), version=1).raise_for_errors()
        assert report.results[0].transport == "disk"
        assert generate(host, engine, report.served_name, DATA["prompts"][1]) == DATA["expected"][0][1]
    engine.unload_adapter(report.served_name)


def test_rank_above_max_is_refused_and_the_previous_version_keeps_serving(
    host: Any, engine: VLLMInProcessEngine, tmp_path: Path
) -> None:
    with Publisher(engine, name="ranked", keep=2, root=tmp_path / "store") as publisher:
        first = publisher.publish(Adapter.load(DATA["adapters"][0]), version=1).raise_for_errors()
        report = publisher.publish(Adapter.load(DATA["rank32"]), version=2)
        error = report.results[0].error
        assert isinstance(error, RankTooLargeError) and (error.rank, error.max_rank) == (32, 16)
        assert "max_lora_rank" in str(error) or "max rank" in str(error)
    # vLLM's own refusal (no pre-flight) maps to the same type.
    with pytest.raises(RankTooLargeError) as info:
        engine.load_adapter("ranked-direct", DATA["rank32"])
    assert (info.value.rank, info.value.max_rank) == (32, 16) and "max_lora_rank" in str(info.value)
    assert engine.list_adapters() == [first.served_name]
    assert generate(host, engine, first.served_name, DATA["prompts"][0]) == DATA["expected"][0][0]
    engine.unload_adapter(first.served_name)


def test_adapters_in_use_sees_a_running_request(host: Any, engine: VLLMInProcessEngine) -> None:
    from vllm import SamplingParams

    engine.load_adapter("busy@v1", DATA["adapters"][0])
    # What it reported, once each: the watcher below looks for as long as the request decodes,
    # which on a busy box was long enough for a list of every look to fill the machine's 24 GB
    # (CI of 2026-12-06: the peer OOM-killed).
    seen: set[frozenset[str] | None] = set()
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    request = engine.lora_request("busy@v1")
    if MODE == "async":

        async def long() -> None:
            async for _ in host.llm.generate({"prompt_token_ids": [5, 6, 7]}, params, request_id="busy-1", lora_request=request):
                seen.add(engine.adapters_in_use())

        host.run(long())
    else:
        # LLM.generate blocks its caller: look from another thread while it decodes.
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                seen.add(engine.adapters_in_use())
                time.sleep(0.0005)  # leave the decoding thread the interpreter

        watcher = threading.Thread(target=watch)
        watcher.start()
        host.generate([{"prompt_token_ids": [5, 6, 7]}], params, lora_request=request, use_tqdm=False)
        done.set()
        watcher.join()
    assert frozenset({"busy@v1"}) in seen
    assert engine.adapters_in_use() == frozenset()
    engine.unload_adapter("busy@v1")


def test_a_name_is_loaded_again_only_once_its_unloaded_version_finished(host: Any, engine: VLLMInProcessEngine) -> None:
    """vLLM 0.32 compares LoRARequests by name alone (0.34 adds the LoRA id) and collects a batch's
    requests in a set: the name loaded again while a request of its unloaded version runs would
    be two ids vLLM takes for one adapter. The load is refused meanwhile, and loads after."""
    from vllm import SamplingParams

    name = "again@v1"
    engine.load_adapter(name, DATA["adapters"][0])
    params = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)
    request = engine.lora_request(name)
    refused: list[AdapterAlreadyLoadedError] = []
    if MODE == "async":

        async def long() -> None:
            async for _ in host.llm.generate({"prompt_token_ids": [5, 6, 7]}, params, request_id="again-1", lora_request=request):
                if not refused:
                    await engine.aunload_adapter(name)
                    with pytest.raises(AdapterAlreadyLoadedError) as info:
                        await engine.aload_adapter(name, DATA["adapters"][1])
                    refused.append(info.value)

        host.run(long())
    else:
        # LLM.generate blocks its caller: unload and load from another thread while it decodes.
        def swap() -> None:
            deadline = time.monotonic() + 60
            while name not in (engine.adapters_in_use() or ()) and time.monotonic() < deadline:
                time.sleep(0.001)
            engine.unload_adapter(name)
            try:
                engine.load_adapter(name, DATA["adapters"][1])
            except AdapterAlreadyLoadedError as exc:
                refused.append(exc)

        swapper = threading.Thread(target=swap)
        swapper.start()
        host.generate([{"prompt_token_ids": [5, 6, 7]}], params, lora_request=request, use_tqdm=False)
        swapper.join(timeout=120)
    assert refused and "tells adapters apart by name alone" in str(refused[0]), refused
    assert name not in engine.list_adapters()
    engine.load_adapter(name, DATA["adapters"][1])  # nothing of the unloaded version runs now
    assert generate(host, engine, name, DATA["prompts"][0]) == DATA["expected"][1][0]
    engine.unload_adapter(name)


def test_sleeping_engine_refuses_publishing_with_a_typed_error(host: Any, engine: VLLMInProcessEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's CPU build has no sleep mode (it needs CUDA): the engine core's own is_sleeping
    # answer is switched to True, everything else is the real engine.
    core = host.llm if MODE == "async" else host.llm_engine

    async def asleep_async() -> bool:
        return True

    monkeypatch.setattr(core, "is_sleeping", asleep_async if MODE == "async" else (lambda: True))
    with pytest.raises(EngineUnavailableError, match="wake_up"):
        engine.load_adapter("sleepy@v1", DATA["adapters"][0])
    monkeypatch.undo()
    assert "sleepy@v1" not in engine.list_adapters()


def test_blocking_call_on_the_asyncllm_loop_is_refused(host: Any, engine: VLLMInProcessEngine) -> None:
    if MODE != "async":
        pytest.skip("AsyncLLM only")

    async def blocking() -> None:
        engine.list_adapters()  # no engine call: fine
        engine.load_adapter("x@v1", DATA["adapters"][0])

    with pytest.raises(ConfigError, match="a-prefixed"):
        host.run(blocking())


def test_an_llm_without_lora_is_refused(tmp_path: Path) -> None:
    if MODE != "llm":
        pytest.skip("one extra engine per run is enough on the CPU build")
    from vllm import LLM

    plain = LLM(model=DATA["model_dir"], dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=2)
    engine = connect("vllm-inprocess", llm=plain)
    assert engine.capabilities().lora is False
    report = Publisher(engine, name="plain", root=tmp_path / "store").publish(Adapter.load(DATA["adapters"][0]), version=1)
    assert isinstance(report.results[0].error, LoraNotEnabledError) and "enable_lora=True" in str(report.results[0].error)
    with pytest.raises(LoraNotEnabledError):
        engine.load_adapter("plain@v1", DATA["adapters"][0])
    plain.llm_engine.engine_core.shutdown()


def test_not_an_llm_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="vllm.LLM"):
        connect("vllm-inprocess", llm=object())


# -- the shipped conformance suite ---------------------------------------------------------------------


class TestConformance(EngineConformance):
    @pytest.fixture
    def engine(self, engine: VLLMInProcessEngine) -> VLLMInProcessEngine:  # type: ignore[override]
        return engine
