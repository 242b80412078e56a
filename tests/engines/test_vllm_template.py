"""The worker's build from a remembered layout (engines/vllm/_template.py) is vLLM's own build:
checked against the installed vLLM's ``LoRAModel.from_lora_tensors``, module by module, for the
next version of a layout, and refused wherever vLLM's build did something else with a tensor."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "lorasync"

# Runs in the vLLM venv: vLLM's real classes, lorasync's template.
SCRIPT = r"""
import json, sys, types
import torch
from lorasync.engines.vllm._surface import resolve
from lorasync.engines.vllm._template import build_from_template, layout_key, remember, template_builds

LoRAModel, PEFTHelper = resolve("LoRAModel"), resolve("PEFTHelper")
CONFIG = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "down_proj"], "rank_pattern": {"down_proj": 4}, "alpha_pattern": {"down_proj": 12}}

def adapter(seed, dtype=torch.bfloat16, r_down=4, extra=None):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(3):
        for module, (o, i, r) in {"self_attn.q_proj": (48, 32, 8), "self_attn.k_proj": (16, 32, 8), "self_attn.v_proj": (16, 32, 8), "mlp.down_proj": (32, 80, r_down)}.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{key}.lora_A.weight"] = torch.randn(r, i, generator=g).to(dtype)
            out[f"{key}.lora_B.weight"] = torch.randn(o, r, generator=g).to(dtype)
    out.update(extra or {})
    return out

def vllm_build(tensors, config, model_id, dtype=torch.bfloat16):
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": 4096})
    return LoRAModel.from_lora_tensors(lora_model_id=model_id, tensors=tensors, peft_helper=helper, device="cpu", dtype=dtype, model_vocab_size=512)

def describe(model):
    return {
        name: {k: (repr(v) if not isinstance(v, torch.Tensor) else None) for k, v in sorted(vars(w).items())} | {"class": type(w).__name__}
        for name, w in model.loras.items()
    } | {"__model__": {"class": type(model).__name__, "rank": model.rank, "id": model.id}}

report = {}
manager = types.SimpleNamespace()
first = adapter(1)
key = layout_key(first, CONFIG, "cpu", torch.bfloat16)
built = vllm_build(first, CONFIG, 1)
report["remembered"] = remember(manager, key, built, first)
fold_like = next(iter(built.loras.values())); fold_like.scaling = 1  # what the fold does to vLLM's build after it is remembered
nxt = adapter(2)
ours = build_from_template(manager, layout_key(nxt, CONFIG, "cpu", torch.bfloat16), 7, nxt)
theirs = vllm_build(nxt, CONFIG, 7)
report["same_structure"] = describe(ours) == describe(theirs)
report["diff"] = [k for k in describe(theirs) if describe(ours).get(k) != describe(theirs)[k]][:3]
report["tensors_are_the_copies"] = all(ours.loras[n].lora_a is theirs.loras[n].lora_a and ours.loras[n].lora_b is theirs.loras[n].lora_b for n in theirs.loras)
report["fresh_objects"] = all(ours.loras[n] is not built.loras[n] for n in built.loras) and ours.loras is not built.loras
report["builds"] = template_builds()
# Anything else about the layout is another layout: no template.
report["other_shapes"] = build_from_template(manager, layout_key(adapter(3, r_down=8), CONFIG, "cpu", torch.bfloat16), 8, adapter(3, r_down=8)) is None
report["other_config"] = build_from_template(manager, layout_key(nxt, {**CONFIG, "lora_alpha": 32}, "cpu", torch.bfloat16), 8, nxt) is None
report["other_dtype"] = build_from_template(manager, layout_key(adapter(3, torch.float32), CONFIG, "cpu", torch.bfloat16), 8, adapter(3, torch.float32)) is None
# vLLM's build that cast the tensors (fp32 given, bf16 LoRA dtype) made new ones: never a template.
f32 = adapter(4, torch.float32)
report["cast_refused"] = not remember(types.SimpleNamespace(), layout_key(f32, CONFIG, "cpu", torch.bfloat16), vllm_build(f32, CONFIG, 2), f32)
# A tensor vLLM skipped (base embeddings ride along): not every tensor is a factor, no template.
emb = adapter(5, extra={"base_model.model.model.embed_tokens.base_layer.weight": torch.zeros(512, 32, dtype=torch.bfloat16)})
report["skipped_refused"] = not remember(types.SimpleNamespace(), layout_key(emb, CONFIG, "cpu", torch.bfloat16), vllm_build(emb, CONFIG, 3), emb)
# A module holding something computed from the values: no template.
odd = adapter(6)
odd_built = vllm_build(odd, CONFIG, 4)
next(iter(odd_built.loras.values())).extra = torch.zeros(1)
report["computed_refused"] = not remember(types.SimpleNamespace(), layout_key(odd, CONFIG, "cpu", torch.bfloat16), odd_built, odd)
print(json.dumps(report))
"""


@pytest.mark.vllm
def test_a_remembered_layout_builds_what_vllms_build_builds(vllm_python: Path) -> None:
    env = {"PYTHONPATH": str(ROOT.parent), "PATH": "/usr/bin:/bin", "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run([str(vllm_python), "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["remembered"], report
    # The next version: vLLM's modules, ranks, alphas and scales (rank and alpha patterns
    # included), the very tensors vLLM's build would hold, in objects of its own.
    assert report["same_structure"], report["diff"]
    assert report["tensors_are_the_copies"] and report["fresh_objects"] and report["builds"] == 1
    assert report["other_shapes"] and report["other_config"] and report["other_dtype"]
    assert report["cast_refused"] and report["skipped_refused"] and report["computed_refused"]
