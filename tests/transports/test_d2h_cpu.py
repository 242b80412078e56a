"""Host-side parts of the GPU export paths, runnable without a GPU: the safetensors layout built
in one buffer, header validation, and the CUDA IPC spec codec (JSON, no pickle)."""

from __future__ import annotations

import base64
import copy
import json
import math
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load, load_file, save

from lorasync.engines.vllm_worker import CONFIG_KEY, LoraSyncWorkerExtension
from lorasync.wire.cuda_ipc import SPEC_VERSION, CudaIpcUnavailableError, share_tensors, import_tensors, parse_spec
from lorasync.wire.d2h import serialize
from lorasync.wire.layout import plan as layout
from lorasync.wire.views import plan_views, views
from lorasync.wire.shm import read_segment


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "b16": torch.randn(3, 5, generator=g).to(torch.bfloat16),  # 30 bytes: the next tensor would be misaligned in given order
        "f64": torch.randn(7, generator=g).double(),
        "i8": torch.randint(-9, 9, (5,), generator=g, dtype=torch.int8),
        "f32": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "empty": torch.zeros(0, 2),
    }


def test_one_buffer_is_a_safetensors_file_with_aligned_views(tmp_path) -> None:
    tensors = _tensors()
    buf = serialize(tensors, {"k": "v"})
    parsed = load(bytes(buf.data.numpy()))
    assert list(buf.tensors) == list(tensors)
    for key, t in tensors.items():
        assert torch.equal(parsed[key], t) and torch.equal(buf.tensors[key], t)
        # Views into the one buffer, not copies.
        if t.numel():
            assert buf.tensors[key].untyped_storage().data_ptr() == buf.data.untyped_storage().data_ptr()
    assert buf.write_to(tmp_path / "x.safetensors") == buf.nbytes
    assert all(torch.equal(load_file(str(tmp_path / "x.safetensors"))[k], t) for k, t in tensors.items())
    with buf.to_shm() as seg:
        out, meta = read_segment(seg.name, seg.nbytes)
    assert meta == {"k": "v"} and all(torch.equal(out[k], t) for k, t in tensors.items())


def test_adapter_data_forms_one_group_per_input_width_and_one_for_all_b() -> None:
    """Every lora_A of one input width, and every lora_B (trailing dim r), share a group: one
    gather kernel and one split each, however many layers."""
    tensors = {}
    for layer in range(3):
        for module, (out, inp) in {"q": (64, 32), "k": (16, 32), "down": (32, 96)}.items():
            tensors[f"l{layer}.{module}.lora_A.weight"] = torch.randn(4, inp).bfloat16()
            tensors[f"l{layer}.{module}.lora_B.weight"] = torch.randn(out, 4).bfloat16()
    plan = layout(tensors).plan
    assert [(g.trailing, len(g.keys)) for g in plan.groups] == [((32,), 6), ((4,), 9), ((96,), 3)]
    buf = serialize(tensors)
    assert list(buf.tensors) == list(tensors)
    assert all(torch.equal(buf.tensors[k], t) for k, t in tensors.items())
    # A consumer that only has the header finds the same groups.
    header = json.loads(bytes(buf.data[8 : 8 + int.from_bytes(bytes(buf.data[:8]), "little")]))
    assert plan_views(header).groups == plan.groups


_DTYPE_CHOICES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int8, torch.bool]


@st.composite
def _tensor_dicts(draw) -> dict[str, torch.Tensor]:
    n = draw(st.integers(0, 12))
    out = {}
    for i in range(n):
        dtype = draw(st.sampled_from(_DTYPE_CHOICES))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        t = (torch.arange(math.prod(shape)).reshape(shape) * (i + 3) % 7).to(dtype)
        if draw(st.booleans()) and t.dim() == 2:
            t = t.t()  # not contiguous
        out[f"t{i}." + draw(st.sampled_from(["a", "é", "\"q\"", ""]))] = t
    return out


@settings(max_examples=200, deadline=None)
@given(_tensor_dicts(), st.sampled_from([0, 1, 8, 1 << 20]))
def test_any_tensors_round_trip_through_safetensors_bit_exact(tensors, chunk_bytes) -> None:
    buf = serialize(tensors, {"m": "1"}, chunk_bytes=chunk_bytes)
    parsed = load(bytes(buf.data.numpy()))
    assert list(buf.tensors) == list(tensors)
    for key, t in tensors.items():
        for got in (parsed[key], buf.tensors[key]):
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), key


@settings(max_examples=200, deadline=None)
@given(_tensor_dicts())
def test_views_of_files_written_by_safetensors_equal_its_own_load(tensors) -> None:
    """Headers lorasync did not write (safetensors orders data by dtype, then name)."""
    raw = save({k: t.contiguous() for k, t in tensors.items()})
    size = int.from_bytes(raw[:8], "little")
    flat = torch.frombuffer(bytearray(raw[8 + size :]) or bytearray(1), dtype=torch.uint8)
    out = views(flat, json.loads(raw[8 : 8 + size]))
    assert set(out) == set(tensors)
    for key, t in tensors.items():
        assert out[key].shape == t.shape and torch.equal(out[key], t), key


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]},  # 4 floats need 16 bytes
        {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},  # past the end
        {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]},
        {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]},
        {"dtype": "F32", "shape": [1], "data_offsets": [0]},
    ],
)
def test_views_reject_headers_that_do_not_fit(entry) -> None:
    with pytest.raises(ValueError):
        views(torch.zeros(16, dtype=torch.uint8), {"x": entry})


def test_views_copy_misaligned_entries() -> None:
    flat = torch.arange(16, dtype=torch.uint8)
    out = views(flat, {"x": {"dtype": "I16", "shape": [2], "data_offsets": [1, 5]}})
    assert out["x"].tolist() == flat[1:5].clone().view(torch.int16).tolist()


def _spec() -> dict:
    return {
        "version": SPEC_VERSION,
        "nbytes": 16,
        "header": json.dumps({"__metadata__": {CONFIG_KEY: "{}"}, "x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}),
        "ipc": {
            "device": 0,
            "device_uuid": "GPU-00000000-0000-0000-0000-000000000000",
            "handle": base64.b64encode(b"h" * 64).decode(),
            "storage_size": 1 << 20,
            "storage_offset": 0,
            "event": base64.b64encode(b"e" * 64).decode(),
            "event_sync": True,
        },
    }


def test_spec_survives_json_and_decodes() -> None:
    fields = parse_spec(json.loads(json.dumps(_spec())))
    assert fields["handle"] == b"h" * 64 and fields["event"] == b"e" * 64 and fields["nbytes"] == 16


@pytest.mark.parametrize(
    "path,value",
    [
        (("version",), 99),
        (("nbytes",), -1),
        (("nbytes",), 2 << 20),  # larger than the shared storage
        (("ipc", "handle"), "not base64!"),
        (("ipc", "handle"), ""),
        (("ipc", "device"), True),
        (("ipc", "storage_size"), "1"),
        (("ipc", "event_sync"), 1),
        (("header",), json.dumps({"__metadata__": {"k": 1}})),
        (("header",), "{not json"),
        (("header",), {"x": {}}),
        (("ipc",), None),
    ],
)
def test_spec_rejects_bad_fields(path, value) -> None:
    spec = copy.deepcopy(_spec())
    target = spec
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ValueError):
        parse_spec(spec)


def test_export_needs_cuda_tensors() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        share_tensors({"x": torch.zeros(2)})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_worker_without_cuda_declines_so_the_client_falls_back() -> None:
    with pytest.raises(CudaIpcUnavailableError):
        import_tensors(_spec())
    worker = types.SimpleNamespace()  # no LoRA manager is touched when declining
    answer = LoraSyncWorkerExtension.lorasync_stage_adapter_cuda(worker, json.dumps({"token": "t", **_spec()}))  # type: ignore[arg-type]
    assert answer["staged"] is False and "CUDA" in answer["reason"]


def test_worker_rejects_bad_token() -> None:
    with pytest.raises(ValueError, match="token"):
        LoraSyncWorkerExtension.lorasync_stage_adapter_cuda(types.SimpleNamespace(), json.dumps({"token": "../x", **_spec()}))  # type: ignore[arg-type]
