"""The content hash of a GPU adapter is computed on the GPU: same value as the lanes computed on
the host from the same bytes, and nothing but the 16-byte result crosses to the host."""

from __future__ import annotations

import torch

from lorasync import Adapter
from lorasync.adapter._config import AdapterConfig
from lorasync.wire import device_hash


def _adapter(device: str, r: int = 8, layers: int = 4, dtype: torch.dtype = torch.float32) -> Adapter:
    g = torch.Generator(device=device).manual_seed(0)
    t = {}
    for i in range(layers):
        k = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        t[f"{k}.lora_A.weight"] = torch.randn(r, 256, device=device, dtype=dtype, generator=g)
        t[f"{k}.lora_B.weight"] = torch.randn(256, r, device=device, dtype=dtype, generator=g)
    return Adapter(t, AdapterConfig(r=r, lora_alpha=2 * r))


def test_gpu_lanes_equal_host_lanes() -> None:
    a = _adapter("cuda", dtype=torch.bfloat16)
    keys = sorted(a.tensors)
    gpu = device_hash.lanes([a.tensors[k] for k in keys])
    host = device_hash.lanes([a.tensors[k].cpu() for k in keys])
    assert gpu == host


def test_gpu_content_hash_is_device_hash_and_changes_with_one_element() -> None:
    a = _adapter("cuda")
    h = a.content_hash
    assert h.startswith(device_hash.PREFIX)
    assert a.matches_hash(h)
    key = sorted(a.tensors)[3]
    with torch.no_grad():
        a.tensors[key].view(-1)[17] += 1e-3
    assert a.content_hash != h
    assert not a.matches_hash(h)


def test_gpu_content_hash_moves_only_the_result_to_the_host() -> None:
    a = _adapter("cuda", r=16, layers=16)
    a.content_hash  # warm-up (kernels, allocator)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        a.content_hash
        torch.cuda.synchronize()
    copies = [e for e in prof.events() if "DtoH" in e.name or "Device -> Pageable" in e.name or "Device -> Pinned" in e.name]
    assert len(copies) <= 1, [e.name for e in copies]


def test_fused_lanes_equal_the_torch_form_bit_for_bit() -> None:
    from lorasync.wire import _device_hash_gpu

    g = torch.Generator(device="cuda").manual_seed(1)
    for n in (1, 7, _device_hash_gpu.BLOCK - 1, _device_hash_gpu.BLOCK, _device_hash_gpu.BLOCK + 1, 3_000_017):
        for offset in (0, 5, 2**40 + 3):
            words = torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, device="cuda", generator=g)
            words[0] = -1  # every bit set: the shifts must be logical
            fused = _device_hash_gpu.lanes_fused(words, offset, device_hash._SEEDS)
            assert fused is not None, "Triton ships with PyTorch's CUDA wheels: the fused pass must run here"
            assert fused.tolist() == device_hash.torch_lanes(words, offset).tolist(), (n, offset)


def test_fused_and_torch_forms_give_one_content_hash_over_chunks() -> None:
    a = _adapter("cuda", r=16, layers=24)
    keys = sorted(a.tensors)
    small = device_hash.lanes([a.tensors[k] for k in keys], chunk_bytes=1 << 16)  # many chunks, fused
    host = device_hash.lanes([a.tensors[k].cpu() for k in keys], chunk_bytes=1 << 16)  # torch form on the host
    assert small == host


def test_fused_lanes_decline_what_is_not_one_flat_run_of_words() -> None:
    from lorasync.wire import _device_hash_gpu

    words = torch.arange(64, dtype=torch.int64, device="cuda")
    assert _device_hash_gpu.lanes_fused(words[::2], 0, device_hash._SEEDS) is None  # strided: the torch form takes it
    assert _device_hash_gpu.lanes_fused(words.view(8, 8), 0, device_hash._SEEDS) is None
    assert _device_hash_gpu.lanes_fused(words.to(torch.int32), 0, device_hash._SEEDS) is None
