"""Device-to-host export: bit-exact, a valid safetensors file, ordered after the caller's GPU work."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load, load_file

from _gpu_helpers import adapter_on_gpu

from lorasync import Adapter
from lorasync.wire.d2h import serialize, to_shm_segment
from lorasync.wire.shm import read_segment


@pytest.mark.parametrize("chunk_bytes", [0, 4096, 1 << 28])
def test_serialize_is_bit_exact_and_a_safetensors_file(chunk_bytes: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    tensors = {
        "f32": torch.randn(33, 17, device="cuda", generator=g),
        "bf16": torch.randn(5, 7, device="cuda", generator=g).to(torch.bfloat16),
        "transposed": torch.randn(16, 48, device="cuda", generator=g).t(),  # not contiguous
        "cpu_f16": torch.randn(9, generator=torch.Generator().manual_seed(2)).half(),
        "i8": torch.randint(-100, 100, (3, 3), device="cuda", generator=g, dtype=torch.int8),
        "empty": torch.zeros(0, 4, device="cuda"),
        "no_columns": torch.zeros(3, 0, device="cuda"),
        "scalar": torch.tensor(2.5, device="cuda"),
        "cpu_f32_beside_cuda": torch.randn(4, 17, generator=torch.Generator().manual_seed(3)),  # joins f32's group
    }
    buf = serialize(tensors, {"k": "v"}, chunk_bytes=chunk_bytes)
    assert buf.data.is_pinned()
    parsed = load(bytes(buf.data.numpy()))
    for key, t in tensors.items():
        ref = t.cpu()
        assert buf.tensors[key].device.type == "cpu"
        assert buf.tensors[key].dtype == ref.dtype and torch.equal(buf.tensors[key], ref), key
        assert torch.equal(parsed[key], ref), key


def test_serialize_waits_for_work_queued_before_it() -> None:
    t = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the fill on the same stream
    t.fill_(7.0)
    buf = serialize({"t": t})
    assert bool((buf.tensors["t"] == 7.0).all())


def test_to_host_keeps_content_and_hash(tmp_path) -> None:
    gpu = adapter_on_gpu()
    host = gpu.to_host()
    assert all(t.device.type == "cpu" for t in host.tensors.values())
    # A GPU adapter is hashed on its GPU (dev128); the host copy is recognised as the same bytes.
    assert gpu.content_hash.startswith("dev128:")
    assert host.matches_hash(gpu.content_hash)
    assert list(host.tensors) == list(gpu.tensors)
    for key, t in gpu.tensors.items():
        assert torch.equal(host.tensors[key], t.cpu())
    assert host.to_host() is host


def test_save_of_gpu_adapter_loads_back_exactly(tmp_path) -> None:
    gpu = adapter_on_gpu(seed=3)
    path = gpu.save(tmp_path / "a")
    raw = load_file(str(path / "adapter_model.safetensors"))
    assert set(raw) == set(gpu.tensors)
    loaded = Adapter.load(path)
    assert loaded.matches_hash(gpu.content_hash)  # the same bytes, hashed on the host
    assert loaded.content_hash == gpu.to_host().content_hash


def test_shared_memory_segment_from_gpu_tensors() -> None:
    gpu = adapter_on_gpu(layers=1, seed=4)
    with to_shm_segment(gpu.tensors, {"m": "1"}) as seg:
        out, meta = read_segment(seg.name, seg.nbytes)
    assert meta == {"m": "1"}
    for key, t in gpu.tensors.items():
        assert torch.equal(out[key], t.cpu())


def test_a_changed_structure_is_never_exported_with_the_last_layout() -> None:
    """serialize starts the transfers with the previous export's layout when the ends of the
    structure look the same, and checks the whole structure while they run: tensors that differ
    in between in shape (even with the same total bytes), dtype or key must still come out exact."""
    g = torch.Generator(device="cuda").manual_seed(5)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g)

    def check(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
        buf = serialize(tensors, metadata)
        parsed = load(bytes(buf.data.numpy()))
        assert list(buf.tensors) == list(tensors)
        for key, t in tensors.items():
            assert buf.tensors[key].shape == t.shape and torch.equal(buf.tensors[key], t.cpu()), key
            assert torch.equal(parsed[key], t.cpu()), key

    def adapter(rows: tuple[int, ...], middle_dtype: torch.dtype = torch.float32, middle_key: str = "t1") -> dict[str, torch.Tensor]:
        out = {f"t{i}": rand(n, 8) for i, n in enumerate(rows)}
        out[middle_key] = out.pop("t1").to(middle_dtype)
        return dict(sorted(out.items(), key=lambda kv: kv[0][-1]))

    check(adapter((4, 12, 4, 12)))
    check(adapter((4, 12, 4, 12)))  # the guess holds
    check(adapter((4, 12, 4, 12)), {"m": "1"})  # other metadata: its own guess
    check(adapter((4, 4, 12, 12)))  # same ends and bytes, rows moved in between
    check(adapter((4, 12, 4, 12), torch.bfloat16))  # same shapes, one dtype changed in between
    check(adapter((4, 12, 4, 12), middle_key="u1"))  # one key changed in between
    odd = adapter((4, 12, 4, 12))
    odd["t1"] = rand(8, 12)  # in between, a tensor the guessed gathers cannot take
    check(odd)
    check({f"t{i}": rand(3, n) for i, n in enumerate((5, 6, 7))})  # other ends: no guess


@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 20, 32 << 20])
def test_pieces_are_exact_and_ordered_against_the_callers_stream(chunk_bytes: int) -> None:
    """Tensors of one GPU in several pieces and groups: every gather must follow the caller's
    work queued just before (a slow fill), and nothing the caller queues after the call may
    overwrite what has not been copied yet (the inputs freed and their memory refilled before the
    wait). It caught a side-stream variant whose buffer reused a gather's freed memory."""
    from lorasync.wire.d2h import start_copy

    g = torch.Generator(device="cuda").manual_seed(6)
    tensors = {
        **{f"a{i}": torch.randn(16, 1 << 15, device="cuda", generator=g).to(torch.bfloat16) for i in range(6)},  # 1 MiB each
        **{f"b{i}": torch.randn(1 << 14, 16, device="cuda", generator=g) for i in range(3)},  # 1 MiB each, another group
        "c": torch.randint(0, 100, (3, 5), device="cuda", generator=g, dtype=torch.int32),
    }
    last = torch.zeros(1 << 18, 4, device="cuda")
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the fill on the caller's stream
    last.fill_(5.0)
    tensors["z"] = last
    expected = {k: t.cpu() for k, t in tensors.items()}  # waits for the fill: reference only
    torch.cuda._sleep(200_000_000)
    tensors["z"].fill_(6.0)  # queued behind another sleep: the export must see it
    expected["z"] = torch.full_like(expected["z"], 6.0)
    buf, wait = start_copy(tensors, chunk_bytes=chunk_bytes)
    del tensors, last
    junk = torch.full((16 << 20,), 0xAB, dtype=torch.uint8, device="cuda")  # reuses freed memory
    wait()
    parsed = load(bytes(buf.data.numpy()))
    for key, ref in expected.items():
        assert torch.equal(buf.tensors[key], ref), key
        assert torch.equal(parsed[key], ref), key
    del junk
