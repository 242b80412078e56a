"""Megatron ↔ FSDP/PEFT for MoE LoRA against the real Megatron-Bridge: one trained MoE LoRA, two
exports, one Adapter, bit for bit, and one forward.

The real peer (``peers/bridge_peer.py`` in the Megatron venv, 2 gloo CPU ranks) builds a tiny
Qwen3-MoE in Megatron-Bridge with fused ``LoRA`` on attention, SequentialMLP experts and the
router, at expert parallelism 2 and 1, gives it random adapter values, exports it with
``megatron.export`` and keeps Megatron's own logits. This side puts the same factors into a PEFT
``target_parameters`` LoRA over the HF checkpoint (experts fused the way transformers 5 holds
them, ``lorasync.adapter._moe.fuse``), exports that with ``fsdp.export`` and checks: the two Adapters
hold the same tensors bit for bit, and HF+PEFT with the fused LoRA computes Megatron's logits.
Grouped-GEMM experts have no CPU kernel in TransformerEngine; ``test_moe_cross_check.py`` covers
them with spec-built shards. Skips without the venv (fails under ``LORASYNC_REQUIRE_MEGATRON=1``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lorasync import Adapter
from lorasync.adapter._moe import LAYOUT, fuse, group_experts
from lorasync.exporters.fsdp import export

from test_megatron_bridge_peer import DENSE, _case, run_peer

CASES = [
    _case("moe-xcheck-ep2", "moe", "lora", [*DENSE, "router"], ep=2),
    _case("moe-xcheck-ep1", "moe", "lora", [*DENSE, "router"], ep=1),
]


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Any]]]:
    work = tmp_path_factory.mktemp("megatron-moe-xcheck")
    return work / "scratch", run_peer(CASES, work)


def _peft_with(adapter: Adapter, checkpoint: Path) -> Any:
    """A PEFT target_parameters LoRA over ``checkpoint`` computing exactly ``adapter``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    config = LoraConfig(
        r=adapter.config.r, lora_alpha=adapter.config.lora_alpha, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"],
    )  # fmt: skip
    model = get_peft_model(base, config).eval()
    modules = dict(model.base_model.model.named_modules())
    groups = group_experts(adapter.modules)
    with torch.no_grad():
        for module in adapter.modules:
            if module in (m for g in groups.values() for m in g.values()):
                continue
            a, b = adapter.pair(module)
            modules[module].lora_A["default"].weight.copy_(a)
            modules[module].lora_B["default"].weight.copy_(b)
        for path, members in groups.items():
            owner, _, param = path.rpartition(".")
            rule = next(r for r in LAYOUT if r.param == param)
            wrapper = modules[owner] if param == "down_proj" else modules[f"{owner}.base_layer"]
            assert wrapper.parameter_name == param
            a, b = fuse(rule, {k: adapter.pair(m) for k, m in members.items()}, wrapper.num_experts)
            wrapper.lora_A["default"].weight.copy_(a)
            wrapper.lora_B["default"].weight.copy_(b)
    return model


@pytest.mark.parametrize("case", [c["id"] for c in CASES])
def test_megatron_and_peft_target_parameters_export_the_same_adapter(peer: tuple[Path, dict[str, dict[str, Any]]], case: str) -> None:
    from safetensors.torch import load_file

    scratch, results = peer
    result = results[case]
    assert "crash" not in result, result.get("trace", result)
    assert "offline_error" not in result and result["online_equals_offline"] is True, result
    assert result["forward_max_diff"] < 1e-5, result  # Megatron's forward = PEFT serving the export
    megatron_adapter = Adapter.load(scratch / case)
    assert len(group_experts(megatron_adapter.modules)) == 4 * 2  # 4 layers x (gate_up, down)
    assert "model.layers.3.mlp.gate" in megatron_adapter.modules

    peft_model = _peft_with(megatron_adapter, scratch / "moe")
    fsdp_adapter = export(peft_model)
    assert sorted(fsdp_adapter.tensors) == sorted(megatron_adapter.tensors)
    for key, tensor in megatron_adapter.tensors.items():
        assert torch.equal(fsdp_adapter.tensors[key], tensor), key
    assert (fsdp_adapter.config.r, fsdp_adapter.config.lora_alpha) == (megatron_adapter.config.r, megatron_adapter.config.lora_alpha)

    saved = load_file(str(scratch / f"{case}.megatron-logits.safetensors"))
    with torch.no_grad():
        logits = peft_model(input_ids=saved["ids"]).logits
    diff = float((logits - saved["logits"]).abs().max())
    print(f"MOE-XCHECK {case}: fused-expert PEFT vs Megatron logits max |diff| = {diff:.3g}")
    assert diff < 1e-5
