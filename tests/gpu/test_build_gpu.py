"""The worker's batched build (engines/vllm/_build.py) on the GPU: the copy and cast in one kernel
per run and the scale folded by ``_foreach_mul_`` give exactly what vLLM's per-tensor build gives,
and on an H200 the batched multiply is the one taken (else the build is exact but not faster)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from lorasync.engines.vllm import _build
from lorasync.engines.vllm._build import fold_scaling, owned_copy

SCALES = (2.0, 0.5, 1 / 3, 16 / 7, 4.0, 0.125)


class _Weights:
    def __init__(self, b: torch.Tensor, scaling: float) -> None:
        self.lora_b, self.scaling = b, scaling


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fold_scaling_on_the_gpu_is_vllms_optimize(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    loras = {f"layers.{i}.o_proj": _Weights(torch.randn(4096, 16, device="cuda", generator=g).to(dtype), SCALES[i % len(SCALES)]) for i in range(36)}
    want = {}
    for name, w in loras.items():
        b = w.lora_b.clone()
        b *= w.scaling  # LoRALayerWeights.optimize
        want[name] = b
    folded = fold_scaling(loras)
    for name, w in loras.items():
        if w.scaling == 1:
            assert torch.equal(w.lora_b, want[name]), name
    exact = {f"{s:.6g}": _build._EXACT.get(("cuda", dtype, s)) for s in SCALES}
    out = Path(os.environ.get("OUT", "/tmp")) / "build_gpu.jsonl"
    with out.open("a") as f:
        f.write(json.dumps({"dtype": str(dtype), "folded": folded, "batched_exact": exact}) + "\n")
    assert folded == len(loras), f"the batched multiply was not exact on this GPU for {exact}: the build falls back to vLLM's"


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_owned_copy_on_the_gpu_is_the_per_tensor_cast(source: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(2)
    pieces = [torch.randn(n, device="cuda", generator=g).to(source) for n in (16 * 4096, 4096 * 16, 16 * 1024, 12288 * 16)]
    flat = torch.cat(pieces)  # as a staged buffer: views side by side
    shapes = [(16, 4096), (4096, 16), (16, 1024), (12288, 16)]
    tensors, offset = {}, 0
    for i, shape in enumerate(shapes):
        n = shape[0] * shape[1]
        tensors[f"t{i}"] = flat[offset : offset + n].view(shape)
        offset += n
    copies = owned_copy(tensors, torch.bfloat16)
    for key, t in tensors.items():
        assert torch.equal(copies[key], t.to(torch.bfloat16)), key
        assert copies[key].untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
