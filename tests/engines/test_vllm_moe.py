"""MoE LoRA into the real vLLM 0.32 CPU engine, through lorasync's disk and in-memory paths.

Two peer runs, one ``LLM`` each, one after the other: without and with vLLM's mixed MoE LoRA
format (``enable_mixed_moe_lora_format``, which alone loads PEFT's fused 3-D keys). This side
builds the tiny Qwen3-MoE (``lorasync.testing.make_moe_case``), a PEFT
``target_parameters`` LoRA on its attention, experts and router, exports it with ``fsdp.export``
(one LoRA per expert) and runs ``peer_vllm_moe.py`` in the vLLM venv, which loads it into an
in-process ``vllm.LLM`` and compares every expert's LoRA buffers with the adapter's B·A·scale.
Token serving of MoE LoRA runs in the GPU suite: vLLM's CPU build has no MoE LoRA kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from lorasync import Adapter
from lorasync.adapter._keys import peft_key
from lorasync.testing import make_moe_case

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]


def test_moe_adapter_buffers_in_vllm_equal_the_adapter(vllm_python: Path, tmp_path: Path) -> None:
    case = make_moe_case(tmp_path / "case", r=8, alpha=16, router=True)
    adapters = {"moe": str(case.adapter.save(tmp_path / "moe"))}
    # An expert the model does not have (index 9 of 4): vLLM's disk loader refuses it.
    tensors = dict(case.adapter.tensors)
    a, b = case.adapter.pair("model.layers.0.mlp.experts.0.gate_proj")
    tensors[peft_key("model.layers.0.mlp.experts.9.gate_proj", "A")] = a.clone()
    tensors[peft_key("model.layers.0.mlp.experts.9.gate_proj", "B")] = b.clone()
    adapters["bogus_expert"] = str(Adapter(tensors, case.adapter.config).save(tmp_path / "bogus"))
    data = tmp_path / "data.json"
    data.write_text(json.dumps({"model_dir": str(case.base_dir), "adapters": adapters}))
    assert torch.equal(Adapter.load(adapters["moe"]).pair("model.layers.1.mlp.experts.3.down_proj")[0], case.adapter.pair("model.layers.1.mlp.experts.3.down_proj")[0])

    for mode, passed, lines in (("plain", "5 passed, 1 skipped", 2), ("mixed", "1 passed, 5 skipped", 2)):
        out = _run_peer(vllm_python, data, mode, tmp_path)
        assert passed in out, out[-4000:]
        assert out.count("MOE-BUFFERS") == lines, out[-4000:]
        print("\n".join(line for line in out.splitlines() if "MOE-BUFFERS" in line))


def _run_peer(vllm_python: Path, data: Path, mode: str, tmp_path: Path) -> str:
    env = dict(os.environ)
    env.update(
        LORASYNC_MOE_DATA=str(data),
        LORASYNC_MOE_MODE=mode,
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    cmd = [
        str(vllm_python), "-m", "pytest", "-x", "-q", "-s", "-p", "no:cacheprovider", "-o", "python_files=peer_*.py",
        "--basetemp", str(tmp_path / f"peer-{mode}"), str(REPO / "tests" / "engines" / "peer_vllm_moe.py"),
    ]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=1500)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    return out.stdout
