"""CUDA IPC handoff to a second process: bit-exact, its own copy, the producer's memory freed,
and the vLLM client choosing it (with the shared-memory fallback) end to end."""

from __future__ import annotations

import gc
import json

import httpx
import torch
from _gpu_helpers import adapter_on_gpu, digest

from lorasync.engines.vllm import CONFIG_KEY, IPC_PREFIX, VLLMEngine
from lorasync.wire.cuda_ipc import share_tensors


def test_second_process_rebuilds_bit_exact_and_owns_its_copy(consumer) -> None:
    gpu = adapter_on_gpu(layers=4, seed=10)
    expected = digest(gpu.tensors)
    gc.collect()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    export = share_tensors(gpu.tensors, {CONFIG_KEY: json.dumps({"r": 8})})
    assert torch.cuda.memory_allocated() > baseline
    answer = consumer.ask(op="stage_cuda", arg=json.dumps({"token": "t1", **export.spec}))
    assert answer["staged"] is True and answer["tensors"] == len(gpu.tensors)
    assert answer["hashes"] == expected
    assert answer["devices"] == ["cpu"]  # vLLM 0.32 builds adapters in host memory
    export.release()
    # Released means freed, not parked in torch's IPC limbo waiting for a count that never drops.
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= baseline
    # Reuse the freed memory and change the source: the consumer's copy must not move.
    junk = torch.full((export.nbytes,), 0xAB, dtype=torch.uint8, device="cuda")
    for t in gpu.tensors.values():
        t.zero_()
    torch.cuda.synchronize()
    assert consumer.ask(op="hashes", token="t1")["hashes"] == expected
    assert consumer.ask(op="release", token="t1")["released"] is True
    del junk


def test_import_tensors_lands_on_the_gpu_bit_exact(consumer) -> None:
    g = torch.Generator(device="cuda").manual_seed(11)
    tensors = {
        "a": torch.randn(64, 32, device="cuda", generator=g),
        "b": torch.randn(7, 3, device="cuda", generator=g).to(torch.bfloat16),
        "strided": torch.randn(8, 16, device="cuda", generator=g)[:, ::2],
    }
    expected = digest(tensors)
    with share_tensors(tensors) as export:
        answer = consumer.ask(op="import", arg=json.dumps(export.spec))
    assert answer["hashes"] == expected and answer["devices"] == ["cuda"]


def test_consumer_sees_work_queued_before_export(consumer) -> None:
    t = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(200_000_000)
    t.fill_(3.0)
    with share_tensors({"t": t}) as export:  # no synchronisation on the producer side
        answer = consumer.ask(op="import", arg=json.dumps(export.spec))
    assert answer["hashes"] == digest({"t": torch.full((1 << 20,), 3.0)})


def test_worker_without_the_gpu_declines(cpu_consumer) -> None:
    gpu = adapter_on_gpu(layers=1, seed=12)
    with share_tensors(gpu.tensors, {CONFIG_KEY: "{}"}) as export:
        answer = cpu_consumer.ask(op="stage_cuda", arg=json.dumps({"token": "t2", **export.spec}))
    assert answer["staged"] is False and "CUDA" in answer["reason"]


def _engine_routed_to(consumer, calls: list[str], staged: list[dict]) -> VLLMEngine:
    """A VLLMEngine whose /collective_rpc calls run in ``consumer`` (the worker side) and whose
    load route does what the worker's load hook does (stage from the client's stage file) before
    answering as vLLM does; records the worker methods called ("load" for the load route) and
    the staging answers."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        if request.url.path == "/collective_rpc":
            method, arg = body["method"], body["args"][0]
            calls.append(method)
            if method in ("lorasync_stage_adapter_cuda", "lorasync_stage_adapter"):
                answer = consumer.ask(op="stage_cuda" if method.endswith("cuda") else "stage_shm", arg=arg)
                staged.append(answer)
                return httpx.Response(200, json={"results": [answer]})
            if method == "lorasync_release_adapter":
                return httpx.Response(200, json={"results": [consumer.ask(op="release", token=arg)["released"]]})
        if request.url.path == "/v1/load_lora_adapter":
            # The worker's load hook: stage from the client's stage file first (the one-trip
            # path; a token staged by RPC is there already), then vLLM registers the name.
            calls.append("load")
            assert body["lora_path"].startswith(IPC_PREFIX)
            answer = consumer.ask(op="stage_file", token=body["lora_path"][len(IPC_PREFIX) :], errors_too=True)
            if "error" in answer:  # vLLM answers a failed load with its message
                return httpx.Response(400, json={"object": "error", "message": answer["error"], "type": "BadRequestError", "code": 400})
            if answer["staged"] and answer["token"] not in {s.get("token") for s in staged}:
                staged.append(answer)
            return httpx.Response(200, text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")  # vLLM's own answer
        return httpx.Response(404, json={"detail": "Not Found"})

    transport = httpx.MockTransport(handler)
    return VLLMEngine("http://127.0.0.1:8000", transport=transport, async_transport=transport)


def test_vllm_client_hands_gpu_adapters_over_cuda_ipc(consumer) -> None:
    gpu = adapter_on_gpu(layers=2, seed=13)
    gc.collect()  # earlier tests' tensors must not be freed mid-test
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    calls: list[str] = []
    staged: list[dict] = []
    _engine_routed_to(consumer, calls, staged).load_adapter_tensors("p@v1", gpu)
    assert calls == ["load"]  # one round trip: the worker staged from the stage file during the load
    assert staged[0]["hashes"] == digest(gpu.tensors)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= baseline  # the packed buffer (~1.6 MB) went once the worker had its copy


def test_vllm_client_falls_back_to_shared_memory(cpu_consumer) -> None:
    gpu = adapter_on_gpu(layers=2, seed=14)
    calls: list[str] = []
    staged: list[dict] = []
    _engine_routed_to(cpu_consumer, calls, staged).load_adapter_tensors("p@v1", gpu)
    # The load's stage from the file is refused (this worker cannot map the GPU: NO_STAGE), the
    # RPC stage is refused too, and shared memory carries the adapter; each refusal released.
    assert calls == ["load", "lorasync_release_adapter", "lorasync_stage_adapter_cuda", "lorasync_release_adapter", "lorasync_stage_adapter", "load"]
    assert staged[0]["staged"] is False and staged[-1]["hashes"] == digest(gpu.tensors) and staged[-1]["devices"] == ["cpu"]


def _filled(value: float, n: int = 1 << 20) -> dict[str, torch.Tensor]:
    return {"x": torch.full((n,), value, device="cuda"), "y": torch.full((n // 4, 4), -value, device="cuda").to(torch.bfloat16)}


def test_kept_mapping_never_serves_a_stale_or_foreign_buffer(consumer) -> None:
    """The consumer keeps the producer's segment mapped between steps. Whatever the producer's
    allocator does in between — the same block again, another block of the same segment, the
    segment freed (``empty_cache``) and a new one allocated — every import reads this step's
    bytes; a new allocation comes with a new handle, so it is mapped afresh."""

    def step(value: float, keep: bool = False, n: int = 1 << 20):
        tensors = _filled(value, n)
        export = share_tensors(tensors)
        answer = consumer.ask(op="import", arg=json.dumps(export.spec))
        assert answer["hashes"] == digest(tensors), value
        ipc = export.spec["ipc"]
        address = export._flat.data_ptr()
        if not keep:
            export.release()
        return export, ipc["handle"], ipc["storage_offset"], address

    _, h1, _, _ = step(1.0)
    _, h2, _, _ = step(2.0)  # the same block again, most likely: the kept mapping is used
    kept = consumer.ask(op="mappings")
    assert h1 in kept["handles"] and (h2 == h1) == (len(kept["handles"]) == 1)
    held, h3, off3, _ = step(3.0, keep=True)  # still held: the next export gets another block
    other, h4, off4, _ = step(4.0, keep=True)
    assert (h4, off4) != (h3, off3)
    held.release()
    other.release()
    # A buffer of its own segment (72 MiB), freed with the segment (empty_cache) and allocated
    # anew, most likely at the same address: a new handle, mapped afresh, fresh bytes.
    gc.collect()
    torch.cuda.empty_cache()  # no earlier segment to carve it from
    _, h5, _, a5 = step(5.0, n=16 << 20)
    step(6.0, n=16 << 20)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    _, h7, _, a7 = step(7.0, n=16 << 20)
    print(f"segment address before/after empty_cache: {a5:#x} / {a7:#x}, handle changed: {h7 != h5}")
    assert h7 != h5
    assert h7 in consumer.ask(op="mappings")["handles"]
    for value in (8.0, 9.0):  # and steps after it keep reading their own bytes
        step(value, n=16 << 20)
        step(value + 0.5)


def test_consumer_keeps_at_most_max_mappings(consumer) -> None:
    from lorasync.wire.cuda_ipc import MAX_MAPPINGS

    held = []
    for i in range(MAX_MAPPINGS + 2):
        # 24 MiB apiece: above the allocator's 20 MiB segments for mid-sized blocks, so each
        # buffer is a segment of its own with its own handle.
        tensors = _filled(float(i), n=6 << 20)
        export = share_tensors(tensors)
        assert consumer.ask(op="import", arg=json.dumps(export.spec))["hashes"] == digest(tensors)
        held.append(export)
    kept = consumer.ask(op="mappings")["handles"]
    assert len(kept) == MAX_MAPPINGS
    assert held[-1].spec["ipc"]["handle"] in kept and held[0].spec["ipc"]["handle"] not in kept
    for export in held:
        export.release()
