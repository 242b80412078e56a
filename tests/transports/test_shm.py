"""Shared-memory segments are valid safetensors and survive a process boundary bit-exactly."""

import subprocess
import sys
from multiprocessing import shared_memory

import pytest
import torch
from safetensors.torch import load

from lorasync.wire.shm import read_segment, write_segment


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "base_model.model.a.lora_A.weight": torch.randn(4, 16, generator=g),
        "b16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "half": torch.randn(7, generator=g).half(),
        "empty": torch.zeros(0, 4),
    }


def test_segment_is_safetensors_and_round_trips():
    tensors = _tensors()
    with write_segment(tensors, {"k": "v"}) as seg:
        shm = shared_memory.SharedMemory(name=seg.name)
        try:
            parsed = load(bytes(shm.buf[: seg.nbytes]))
        finally:
            shm.close()
        out, meta = read_segment(seg.name, seg.nbytes)
    assert meta == {"k": "v"}
    for key, t in tensors.items():
        assert torch.equal(parsed[key], t) and parsed[key].dtype == t.dtype
        assert torch.equal(out[key], t) and out[key].dtype == t.dtype


def test_other_process_reads_bit_exact(tmp_path):
    tensors = _tensors()
    with write_segment(tensors) as seg:
        code = (
            "import sys, torch; from lorasync.wire.shm import read_segment;"
            f"t,_ = read_segment({seg.name!r}, {seg.nbytes});"
            "torch.save({k: v for k, v in t.items()}, sys.argv[1])"
        )
        out = str(tmp_path / "t.pt")
        subprocess.run([sys.executable, "-c", code, out], check=True)
        got = torch.load(out, weights_only=True)
        # The producer's segment still exists after the consumer exited (no resource-tracker unlink).
        shared_memory.SharedMemory(name=seg.name).close()
    for key, t in tensors.items():
        assert torch.equal(got[key], t)


def test_truncated_or_corrupt_segment_rejected():
    with write_segment(_tensors()) as seg:
        with pytest.raises(ValueError):
            read_segment(seg.name, 6)
        shm = shared_memory.SharedMemory(name=seg.name)
        try:
            shm.buf[0:8] = (10**9).to_bytes(8, "little")
        finally:
            shm.close()
        with pytest.raises(ValueError):
            read_segment(seg.name, seg.nbytes)


@pytest.mark.parametrize("shape", [[2**63, 0], [0, 2**63], [2**40, 2**40, 0]])
@pytest.mark.parametrize("one_buffer", [False, True])
def test_a_header_declaring_an_impossible_empty_shape_is_a_wire_format_error(shape: list[int], one_buffer: bool) -> None:
    # Outside attack (00:00): zero bytes, so it passed the size check; torch then overflowed.
    import json
    import struct

    from lorasync.errors import WireFormatError
    from lorasync.wire.reading import read, read_section

    header = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    with pytest.raises(WireFormatError):
        (read_section if one_buffer else read)(memoryview(struct.pack("<Q", len(header)) + header))
