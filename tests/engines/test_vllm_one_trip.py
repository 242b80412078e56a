"""The one-trip GPU load falls back, exactly, where the workers cannot take it: against the real
vLLM CPU server with lorasync's worker extension (which cannot map CUDA memory). The client is
made to see a GPU adapter (the CUDA IPC share stands in for one: a valid spec of memory this
machine has not), so it writes the stage file and loads in one request; the worker answers
NO_STAGE (or not-found where it sees no file), and the client stages the adapter by shared memory
as before: the served tokens are PEFT's, the stage file is gone, nothing is left staged but the
served version, and after two misses in a row the client stops trying."""

from __future__ import annotations

import base64
import json
import os
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from lorasync.engines.vllm import VLLMEngine, _client, _protocol
from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model, make_tiny_model
from lorasync.wire import cuda_ipc

pytestmark = pytest.mark.vllm

PROMPT = [5, 6, 7, 8]


class _Share:
    """What share_tensors returns, for memory of a GPU this machine does not have."""

    def __init__(self, tensors: Any, metadata: Any) -> None:
        header = {"__metadata__": dict(metadata), "x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
        self.spec = {
            "version": cuda_ipc.SPEC_VERSION,
            "nbytes": 16,
            "header": json.dumps(header),
            "ipc": {"device": 0, "device_uuid": "GPU-00000000-0000-0000-0000-000000000000",
                    "handle": base64.b64encode(b"h" * 64).decode(), "storage_size": 1 << 20, "storage_offset": 0,
                    "event": base64.b64encode(b"e" * 64).decode(), "event_sync": True},
        }  # fmt: skip
        self.released = False

    def release(self) -> None:
        self.released = True


def _greedy(model: Any) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT) :].tolist()


def _staged(url: str) -> list[str]:
    answer = httpx.post(f"{url}/collective_rpc", json={"method": "lorasync_staged", "args": []}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["results"][0]


@pytest.mark.parametrize("worker_sees_file", [True, False])
def test_one_trip_load_falls_back_to_the_rpc_stage_exactly(vllm_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, worker_sees_file: bool) -> None:
    shares: list[_Share] = []
    attempts: list[str] = []
    monkeypatch.setattr(_client, "one_cuda_device", lambda tensors: True)
    monkeypatch.setattr(cuda_ipc, "share_tensors", lambda t, m: shares.append(_Share(t, m)) or shares[-1])
    if not worker_sees_file:  # the worker looks in /dev/shm, the client writes elsewhere (another namespace)
        monkeypatch.setattr(_protocol, "STAGE_DIR", str(tmp_path))
    written = _protocol.write_stage_file

    def recording(stage: Any) -> Any:
        attempts.append(stage.token)
        return written(stage)

    monkeypatch.setattr(_client, "write_stage_file", recording)
    run = uuid.uuid4().hex[:8]
    models = [make_peft_model(make_tiny_model(), r=8, alpha=16, seed=40 + i) for i in range(3)]
    with VLLMEngine(vllm_server.url) as engine:
        assert engine.capabilities().tensor_load
        names = [f"onetrip-{run}-{i}@v1" for i in range(3)]
        try:
            for i, (name, model) in enumerate(zip(names, models)):
                engine.load_adapter_tensors(name, export(model))
                assert list(engine.generate(PROMPT, model=name, max_tokens=8).token_ids) == _greedy(model), name
                assert len(attempts) == min(i + 1, 2)  # two misses in a row: no third attempt
                assert not os.path.exists(_protocol.stage_file(attempts[-1]))  # removed once the load answered
                assert all(s.released for s in shares)
            served = set(engine._ipc_tokens.values())
            assert set(_staged(vllm_server.url)) >= served
            assert not set(attempts) & set(_staged(vllm_server.url))  # the failed one-trip tokens left nothing staged
        finally:
            for name in names:
                if name in engine.list_adapters():
                    engine.unload_adapter(name)


@pytest.mark.parametrize("worker", ["cannot_map", "older"])
def test_a_gpu_bucket_for_workers_that_cannot_take_it_goes_through_shared_memory(vllm_server: Any, monkeypatch: pytest.MonkeyPatch, worker: str) -> None:
    """A merged bucket on a GPU, for workers that cannot map it (no CUDA here) or of an older
    lorasync (its ping names no CUDA updates), lands through shared memory, exactly. The older
    worker's method is never called: vLLM 0.32 drops the connection on an unknown method, which
    failed the publish (found by the outside attack)."""
    monkeypatch.setattr(_client, "one_cuda_device", lambda tensors: True)
    monkeypatch.setattr(cuda_ipc, "share_tensors", lambda t, m: _Share(t, m))
    if worker == "older":
        monkeypatch.setattr(VLLMEngine, "_cuda_update_method", "lorasync_no_such_method")
        monkeypatch.setattr(_client, "ping_features", lambda answers: _protocol.ping_features(["lorasync"] * len(answers)))
    model = make_tiny_model()
    name = "model.layers.0.self_attn.o_proj.weight"
    scaled = (model.state_dict()[name] * 1.5).contiguous()
    with VLLMEngine(vllm_server.url) as engine:
        calls: list[str] = []
        rpc = engine._rpc

        def spy(method: str, arg: str, **kwargs: Any) -> Any:
            calls.append(method)
            return (yield from rpc(method, arg, **kwargs))

        monkeypatch.setattr(engine, "_rpc", spy)
        try:
            engine.begin_weight_update()
            try:
                engine.update_weights({name: scaled})
            finally:
                engine.end_weight_update()
            assert engine._cuda_updates is False
            expected = ["lorasync_update_weights"] if worker == "older" else ["lorasync_update_weights_cuda", "lorasync_update_weights"]
            assert [c for c in calls if c.startswith("lorasync_update")] == expected, calls
            with torch.no_grad():
                model.state_dict()[name].copy_(scaled)
            assert list(engine.generate(PROMPT, model="tiny-base", max_tokens=8).token_ids) == _greedy(model), worker
        finally:
            pristine = make_tiny_model().state_dict()[name]
            engine.begin_weight_update()
            try:
                engine.update_weights({name: pristine.contiguous()})
            finally:
                engine.end_weight_update()


def test_the_ping_names_what_every_worker_has() -> None:
    features = _protocol.ping_features
    assert features(["lorasync:cuda_updates", "lorasync:cuda_updates"]) == {"cuda_updates"}
    assert features(["lorasync:cuda_updates", "lorasync"]) == frozenset()  # one older worker: none
    assert features(["lorasync"]) == frozenset()
    for answers in ([], ["other"], [True], None, ["lorasync", None]):
        assert features(answers) is None
