"""The device hash (``dev128:``, lorasync.wire.device_hash): the same bytes give the same value
whatever the chunking, and any change of a tensor's bytes, a key, a shape or the config changes it.
Runs on the CPU here; tests/gpu checks the GPU gives the same lanes and keeps the bytes on the GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lorasync import Adapter
from lorasync.adapter._config import AdapterConfig
from lorasync.wire import device_hash


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16)):
        k = f"base_model.model.model.layers.{i}.mlp.down_proj"
        out[f"{k}.lora_A.weight"] = torch.randn(3, 7 + i, generator=g).to(dtype)  # odd sizes: padding
        out[f"{k}.lora_B.weight"] = torch.randn(5, 3, generator=g).to(dtype)
    return out


def test_lanes_do_not_depend_on_the_chunking() -> None:
    t = list(_tensors().values())
    whole = device_hash.lanes(t)
    for chunk in (1, 8, 24, 100, 1 << 20):
        assert device_hash.lanes(t, chunk_bytes=chunk) == whole


def test_one_dtype_without_padding_gives_the_general_gathers_lanes() -> None:
    # Every adapter lorasync exports is one dtype with no padding: gathered in one C++ call per
    # chunk. The words must be those of the per-tensor gather, whatever the layout and chunking.
    g = torch.Generator().manual_seed(3)
    tensors = [
        torch.randn(8, 16, generator=g).to(torch.bfloat16).requires_grad_(),  # a trainer's parameter
        torch.randn(16, 4, generator=g).to(torch.bfloat16).t(),  # not contiguous
        torch.randn(4, generator=g).to(torch.bfloat16),
        torch.randn(64, 8, generator=g).to(torch.bfloat16)[::2],  # a strided view
    ]
    words = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]).view(torch.int64)
    expected = device_hash.torch_lanes(words, 0).tolist()
    expected = (expected[0] & (2**64 - 1), expected[1] & (2**64 - 1))
    for chunk in (1, 8, 40, 256, 1 << 20):
        assert device_hash.lanes(tensors, chunk_bytes=chunk) == expected
    assert device_hash.lanes(iter(tensors)) == expected  # any iterable, as Adapter hands them


def test_a_tensor_alone_in_its_chunk_hashes_whatever_its_offset_or_lazy_negation() -> None:
    # A slice of a bigger buffer at an odd 2-byte offset (a packed buffer, a fused factor split per
    # module), alone in its chunk (>= the chunk size, the last of a chunk, or the only tensor): the
    # one-dtype gather hands back a view of it, which no word view can take as it is.
    g = torch.Generator().manual_seed(5)
    flat = torch.randn(1000, generator=g).to(torch.bfloat16)
    alone = flat[1:9]
    negated = torch._neg_view(flat[16:24])  # a lazy negation: its bytes are the negated values
    for tensors in ([alone], [flat[1 + 16 * i : 9 + 16 * i] for i in range(4)], [negated], [alone, negated]):
        plain = [t.detach().resolve_neg().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
        expected = device_hash.torch_lanes(torch.cat(plain).view(torch.int64), 0).tolist()
        for chunk in (1, 8, 64, device_hash.CHUNK_BYTES):
            assert device_hash.lanes(tensors, chunk_bytes=chunk) == (expected[0] & (2**64 - 1), expected[1] & (2**64 - 1))


@settings(max_examples=60, deadline=None)
@given(which=st.integers(0, 5), position=st.integers(0, 10_000), bit=st.integers(0, 7))
def test_any_flipped_bit_changes_the_lanes(which: int, position: int, bit: int) -> None:
    t = _tensors()
    keys = sorted(t)
    before = device_hash.lanes([t[k] for k in keys])
    key = keys[which]
    raw = t[key].contiguous().view(-1).view(torch.uint8).clone()
    raw[position % raw.numel()] ^= 1 << bit
    t[key] = raw.view(t[key].dtype).view(t[key].shape)
    after = device_hash.lanes([t[k] for k in keys])
    assert after[0] != before[0] and after[1] != before[1]


def test_swapped_words_and_moved_rows_change_the_lanes() -> None:
    a = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    b = a.flip(0).contiguous()  # the same values, rows moved
    assert device_hash.lanes([a]) != device_hash.lanes([b])
    assert device_hash.lanes([a, b]) != device_hash.lanes([b, a])


def test_digest_covers_the_header() -> None:
    t = _tensors()
    assert device_hash.tensors_digest(t, b"one") != device_hash.tensors_digest(t, b"two")
    assert device_hash.tensors_digest(t, b"one") == device_hash.tensors_digest(dict(reversed(list(t.items()))), b"one")


def test_an_adapter_matches_its_device_digest_and_not_after_a_change() -> None:
    t = _tensors()
    t = {k: v.float() for k, v in t.items()}
    adapter = Adapter(t, AdapterConfig(r=3, lora_alpha=6))
    digest = adapter._device_hash()
    assert digest.startswith(device_hash.PREFIX)
    assert adapter.matches_hash(digest)
    assert adapter.content_hash != digest  # a CPU adapter keeps the host hash; the two kinds never compare equal
    other = Adapter(t, AdapterConfig(r=3, lora_alpha=7))  # same bytes, another scale
    assert not other.matches_hash(digest)
    with torch.no_grad():
        next(iter(t.values())).view(-1)[0] += 1.0
    assert not adapter.matches_hash(digest)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (the CPU test environment does not need it)")
def test_fused_gpu_kernel_interpreted_equals_the_torch_form() -> None:
    """The fused GPU lanes kernel (``wire/_device_hash_gpu``) checked where no GPU is: Triton's
    interpreter runs it on host tensors, in a child process because the interpreter is chosen when
    Triton is imported. ``tests/gpu/test_device_hash_gpu.py`` runs the compiled kernel."""
    script = textwrap.dedent(
        """
        import torch
        from lorasync.wire import _device_hash_gpu as fused, device_hash as d
        for n in (1, 7, fused.BLOCK - 1, fused.BLOCK + 1, 50_001):
            for offset in (0, 5, 2**40 + 3):
                w = torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, generator=torch.Generator().manual_seed(n))
                w[0] = -1
                want = d.torch_lanes(w, offset).tolist()
                assert fused._run(w, offset, d._SEEDS).tolist() == want, (n, offset)
        print("same")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-3000:]


def test_a_fused_kernel_that_cannot_run_falls_back_to_the_same_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton present but unable to build or launch (no C compiler for its launcher, an
    unsupported GPU): the hash is still taken, by the torch form, with one warning, and the
    fused path is not tried again in this process."""
    import contextlib

    from lorasync.errors import LoraSyncWarning
    from lorasync.wire import _device_hash_gpu

    calls = []

    def broken(*args: object) -> None:
        calls.append(args)
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    class OnCuda:  # a word buffer that says it lives on a GPU, as the dispatch reads it
        def __init__(self, words: torch.Tensor) -> None:
            self.words = words
            self.device = torch.device("cuda", 0)
            self.dtype = words.dtype

        def dim(self) -> int:
            return self.words.dim()

        def is_contiguous(self) -> bool:
            return self.words.is_contiguous()

    monkeypatch.setattr(_device_hash_gpu, "_run", broken)
    monkeypatch.setattr(_device_hash_gpu, "_on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_device_hash_gpu, "_BROKEN", [])
    words = OnCuda(torch.arange(10, dtype=torch.int64))
    with pytest.warns(LoraSyncWarning, match="fused GPU hash kernel could not run"):
        assert _device_hash_gpu.lanes_fused(words, 0, device_hash._SEEDS) is None  # type: ignore[arg-type]
    assert _device_hash_gpu.lanes_fused(words, 0, device_hash._SEEDS) is None  # type: ignore[arg-type]
    assert len(calls) == 1  # not tried again


@pytest.mark.parametrize(
    "fault",
    [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB"), RuntimeError("CUDA error: an illegal memory access was encountered")],
)
def test_a_device_fault_in_the_fused_kernel_is_raised_not_hidden(monkeypatch: pytest.MonkeyPatch, fault: Exception) -> None:
    """Out of memory or a CUDA fault is the device's trouble, not the kernel's build: raised, and
    the fused path stays on for the next hash."""
    import contextlib

    from lorasync.wire import _device_hash_gpu

    def faulty(*args: object) -> None:
        raise fault

    class OnCuda:
        def __init__(self, words: torch.Tensor) -> None:
            self.device, self.dtype, self.words = torch.device("cuda", 0), words.dtype, words

        def dim(self) -> int:
            return 1

        def is_contiguous(self) -> bool:
            return True

    monkeypatch.setattr(_device_hash_gpu, "_run", faulty)
    monkeypatch.setattr(_device_hash_gpu, "_on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_device_hash_gpu, "_BROKEN", [])
    with pytest.raises(type(fault)):
        _device_hash_gpu.lanes_fused(OnCuda(torch.arange(4)), 0, device_hash._SEEDS)  # type: ignore[arg-type]
    assert _device_hash_gpu._BROKEN == []
