"""The in-place host path of Adapter (lorasync.adapter._memory): content_hash and save_hashed read
plain CPU tensors through a ctypes view of their memory. Same file bytes and same hash as the
general path, for every kind of plain tensor it takes (parameters, offset views, requires_grad),
and a changed byte is seen however it was written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from lorasync import Adapter, AdapterConfig
from lorasync.adapter import _adapter, _memory
from lorasync.adapter._adapter import _canonical_config


def _tensors(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(5)
    out = {}
    for layer in range(3):
        for leaf, (o, i) in {"q_proj": (96, 64), "down_proj": (64, 160)}.items():
            m = f"base_model.model.model.layers.{layer}.mlp.{leaf}" if leaf == "down_proj" else f"base_model.model.model.layers.{layer}.self_attn.{leaf}"
            out[f"{m}.lora_A.weight"] = torch.randn(8, i, generator=g).to(dtype)
            out[f"{m}.lora_B.weight"] = torch.randn(o, 8, generator=g).to(dtype)
    return out


def _reference_hash(adapter):
    h = xxhash.xxh3_128()
    h.update(_canonical_config(adapter.config).encode())
    for key, tensor in adapter.tensors.items():
        cpu = tensor.detach().contiguous()
        h.update(f"\0{key}\0{cpu.dtype}\0{tuple(cpu.shape)}\0".encode())
        h.update(cpu.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "xxh3-128:" + h.hexdigest()


def _plain_kinds(dtype):
    """Tensors the in-place path takes: plain, Parameters (requires_grad), contiguous views at an
    offset into a larger storage."""
    tensors = _tensors(dtype)
    keys = list(tensors)
    tensors[keys[0]] = torch.nn.Parameter(tensors[keys[0]].clone())
    big = torch.zeros(10_000, dtype=dtype)
    t = tensors[keys[3]]
    big[123 : 123 + t.numel()] = t.reshape(-1)
    tensors[keys[3]] = big[123 : 123 + t.numel()].view(t.shape)  # offset view, contiguous
    return tensors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_in_place_path_writes_and_hashes_what_the_general_path_does(dtype, tmp_path, monkeypatch):
    adapter = Adapter(_plain_kinds(dtype), AdapterConfig(r=8, lora_alpha=16))
    assert _memory.host_views(adapter.tensors) is not None  # the path under test is taken
    fast_path, fast_hash = adapter.save_hashed(tmp_path / "fast")
    fast_plain = adapter.content_hash
    monkeypatch.setattr(_adapter, "host_views", lambda tensors: None)  # the general path
    slow_path, slow_hash = adapter.save_hashed(tmp_path / "slow")
    assert fast_hash == slow_hash == fast_plain == adapter.content_hash == _reference_hash(adapter)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (fast_path / name).read_bytes() == (slow_path / name).read_bytes()
    loaded = Adapter.load(fast_path)
    assert loaded.content_hash == fast_hash
    for key, tensor in adapter.tensors.items():
        assert torch.equal(loaded.tensors[key].view(torch.uint8), tensor.detach().contiguous().view(torch.uint8))


def test_in_place_path_declines_what_it_cannot_read_in_place():
    tensors = _tensors()
    key = next(iter(tensors))
    strided = dict(tensors)
    strided[key] = tensors[key].t().contiguous().t()  # same shape, not contiguous
    assert _memory.host_views(strided) is None
    assert _memory.host_views(tensors) is not None
    adapter = Adapter(strided, AdapterConfig(r=8, lora_alpha=16))
    assert adapter.content_hash == _reference_hash(adapter)
    # Storage the trainer freed after the export (FSDP resizes it to 0): nothing to read in place
    # (a raw read of that address could crash the trainer's process).
    freed = dict(tensors)
    freed[key] = tensors[key].clone()
    freed[key].untyped_storage().resize_(0)
    assert _memory.host_views(freed) is None


def _writes(t):
    """Every way a trainer (or its tools) may change one element without torch's version counter
    of ``t`` seeing it, and the plain in-place op."""
    yield "in-place op", lambda: t.view(-1)[7].add_(1)
    yield ".data", lambda: t.data.view(-1)[7].add_(1)
    yield "numpy view", lambda: t.detach().numpy().reshape(-1).__setitem__(7, t.detach().numpy().reshape(-1)[7] + 1)
    yield "dlpack", lambda: torch.from_dlpack(t.detach()).view(-1)[7].add_(1)
    yield "raw byte", lambda: t.detach().view(torch.uint8).numpy().reshape(-1).__setitem__(13, np.uint8(t.detach().view(torch.uint8).numpy().reshape(-1)[13] ^ 1))


@pytest.mark.parametrize("case", range(5))
def test_a_changed_byte_always_changes_the_hash(case, tmp_path):
    tensors = {k: v.float() for k, v in _tensors().items()}
    adapter = Adapter(tensors, AdapterConfig(r=8, lora_alpha=16))
    target = tensors[list(tensors)[5]]
    before = adapter.content_hash
    saved_before = adapter.save_hashed(tmp_path / "before")[1]
    label, write = list(_writes(target))[case]
    write()
    after = adapter.content_hash
    assert after != before, label
    assert adapter.save_hashed(tmp_path / "after")[1] == after != saved_before, label
    assert after == _reference_hash(adapter), label


def test_in_place_path_declines_lazily_negated_tensors():
    # A neg-bit view holds -x logically and x in memory: read in place it would hash and write x
    # (found by the outside attack on this path).
    tensors = _tensors()
    key = next(iter(tensors))
    negated = dict(tensors)
    negated[key] = torch._neg_view(tensors[key])
    assert negated[key].is_neg() and negated[key].is_contiguous()
    assert _memory.host_views(negated) is None


def test_lazy_zeros_and_negations_hash_and_save_as_their_values(tmp_path):
    # torch's ZeroTensor has no memory (data_ptr 0): read in place it hashed garbage and save()
    # failed with EFAULT as a "disk" error (found by the outside attack). Lazy zeros, negations and
    # conjugations are read as the values they stand for, on every path.
    from lorasync import Adapter
    from lorasync.testing import tiny_llama_adapter

    base = tiny_llama_adapter()
    key = next(k for k in base.tensors if "lora_B" in k)
    lazy = {"zeros": torch._efficientzerotensor(base.tensors[key].shape, dtype=base.tensors[key].dtype), "neg": torch._neg_view(base.tensors[key])}
    real = {"zeros": torch.zeros_like(base.tensors[key]), "neg": -base.tensors[key]}
    for kind in lazy:
        assert _memory.host_views({key: lazy[kind]}) is None
        with_lazy = Adapter({**base.tensors, key: lazy[kind]}, base.config)
        with_real = Adapter({**base.tensors, key: real[kind]}, base.config)
        assert with_lazy.content_hash == with_real.content_hash, kind
        saved = Adapter.load(with_lazy.save(tmp_path / kind))
        assert torch.equal(saved.tensors[key], real[kind]), kind
