"""The speed-only paths of Adapter (benchmark-driven): content_hash hashes tensor memory in place
and save writes safetensors straight from it. Same hash as hashing copies, same file contents as
safetensors' own writer, and PEFT loads the result."""

from __future__ import annotations

import hashlib

import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lorasync import Adapter, AdapterConfig
from lorasync.adapter._adapter import _canonical_config


def _adapter(dtype=torch.bfloat16, *, odd=False):
    g = torch.Generator().manual_seed(3)
    tensors = {}
    for layer in range(2):
        for leaf, (out, inp) in {"q_proj": (256, 256), "v_proj": (128, 256)}.items():
            m = f"base_model.model.model.layers.{layer}.self_attn.{leaf}"
            tensors[f"{m}.lora_A.weight"] = torch.randn(4, inp, generator=g).to(dtype)
            tensors[f"{m}.lora_B.weight"] = torch.randn(out, 4, generator=g).to(dtype)
    if odd:  # a transposed (non-contiguous) view and a tensor that requires grad
        key = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
        tensors[key] = torch.randn(4, 128, generator=g).to(dtype).t()
        tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].requires_grad_(True)
    return Adapter(tensors, AdapterConfig(r=4, lora_alpha=8))


def _reference_hash(adapter, h=None):
    """content_hash as first written (with the hash of today's digest format): every tensor
    copied to bytes before hashing."""
    legacy = h is not None
    h = h or xxhash.xxh3_128()
    h.update(_canonical_config(adapter.config).encode())
    for key, tensor in adapter.tensors.items():
        cpu = tensor.detach().to("cpu").contiguous()
        h.update(f"\0{key}\0{cpu.dtype}\0{tuple(cpu.shape)}\0".encode())
        h.update(cpu.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest() if legacy else "xxh3-128:" + h.hexdigest()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("odd", [False, True])
def test_content_hash_is_unchanged_by_hashing_in_place(dtype, odd):
    adapter = _adapter(dtype, odd=odd)
    assert adapter.content_hash == _reference_hash(adapter)
    # Stores written before the digest format changed recorded bare SHA-256: still recognised.
    assert adapter.matches_hash(_reference_hash(adapter, hashlib.sha256()))
    assert adapter.matches_hash(adapter.content_hash)
    assert not adapter.matches_hash(_reference_hash(_adapter(dtype, odd=not odd), hashlib.sha256()))
    assert not adapter.matches_hash("md5:" + adapter.content_hash)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_save_hashed_returns_the_hash_of_the_bytes_written(dtype, tmp_path):
    adapter = _adapter(torch.float32, odd=True)
    adapter = Adapter({k: t.detach().to(dtype) for k, t in adapter.tensors.items()}, adapter.config)
    path, digest = adapter.save_hashed(tmp_path / "a")
    assert digest == adapter.content_hash == Adapter.load(path).content_hash
    assert (path / "adapter_model.safetensors").read_bytes() == (adapter.save(tmp_path / "b") / "adapter_model.safetensors").read_bytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_saved_weights_equal_safetensors_own_file(dtype, tmp_path):
    adapter = _adapter(torch.float32, odd=True)
    adapter = Adapter({k: t.detach().to(dtype) for k, t in adapter.tensors.items()}, adapter.config)
    adapter.save(tmp_path / "ours")
    save_file({k: t.contiguous() for k, t in adapter.tensors.items()}, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    ours = load_file(str(tmp_path / "ours" / "adapter_model.safetensors"))
    theirs = load_file(str(tmp_path / "theirs.safetensors"))
    assert ours.keys() == theirs.keys() == set(adapter.tensors)
    for key in ours:
        assert ours[key].dtype == dtype and ours[key].shape == theirs[key].shape
        assert torch.equal(ours[key].view(torch.uint8), theirs[key].view(torch.uint8))
    with safe_open(str(tmp_path / "ours" / "adapter_model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert Adapter.load(tmp_path / "ours").content_hash == adapter.content_hash


def test_peft_loads_the_saved_adapter_exactly(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = _adapter(torch.float32)
    adapter.save(tmp_path / "a")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(tmp_path / "a"))
    params = dict(model.named_parameters())
    for key, tensor in adapter.tensors.items():
        assert torch.equal(params[key.replace(".weight", ".default.weight")], tensor)
