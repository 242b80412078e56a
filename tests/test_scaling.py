"""normalize_scaling: per-module PEFT scales folded into lora_B, checked by real PEFT forwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lorasync import Adapter
from lorasync.exporters import normalize_scaling
from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model, make_tiny_model

IDS = torch.randint(4, 512, (2, 10), generator=torch.Generator().manual_seed(3))

CASES: dict[str, dict[str, Any]] = {
    "rank_pattern": {"rank_pattern": {"q_proj": 4, "model.layers.1.mlp.down_proj": 2}},
    "alpha_pattern": {"alpha_pattern": {"v_proj": 64, "model.layers.0.mlp.up_proj": 4}},
    # Overlapping patterns: PEFT takes the first match in insertion order ("q_proj" wins for
    # layer 0), while adapter_config.json is written with sorted keys.
    "overlapping_patterns": {
        "alpha_pattern": {"q_proj": 32, "model.layers.0.self_attn.q_proj": 64},
        "rank_pattern": {"k_proj": 4, "model.layers.1.self_attn.k_proj": 2},
    },
    "rslora": {"use_rslora": True},
    "rslora_with_patterns": {"use_rslora": True, "rank_pattern": {"o_proj": 2}, "alpha_pattern": {"gate_proj": 3}},
}


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _served(directory: Path) -> Any:
    from peft import PeftModel

    return PeftModel.from_pretrained(make_tiny_model(), str(directory)).eval()


def _lora_layers(model: Any) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@pytest.mark.filterwarnings("ignore:.*rslora.*:UserWarning")
@pytest.mark.parametrize("case", list(CASES))
def test_normalized_adapter_keeps_the_peft_forward(case: str, tmp_path: Path) -> None:
    trainer = make_peft_model(make_tiny_model(), r=8, alpha=16, **CASES[case])
    trainer_logits = _logits(trainer)
    adapter = export(trainer)
    assert not adapter.engine_safe_scaling  # the case really needs normalising

    normalized = normalize_scaling(adapter)
    cfg = normalized.config
    assert normalized.engine_safe_scaling and not cfg.use_rslora
    assert all(cfg.scale_for(m) == cfg.global_scale == cfg.lora_alpha / cfg.r for m in normalized.modules)
    for module in adapter.modules:
        assert torch.equal(normalized.pair(module)[0], adapter.pair(module)[0])  # A untouched
        torch.testing.assert_close(normalized.delta(module), adapter.delta(module), rtol=1e-5, atol=1e-7)

    adapter.save(tmp_path / "as-trained")
    normalized.save(tmp_path / "normalized")
    as_trained = _served(tmp_path / "as-trained")
    served = _served(tmp_path / "normalized")
    assert (_logits(as_trained) - trainer_logits).abs().max() <= 1e-5
    # Rescaling B by a ratio that is not a power of two (3/16 for gate_proj in
    # rslora_with_patterns) rounds each fp32 element; the tiny model's 40x LM head magnifies
    # that to ~3e-5 in fp32 logits. Every other case is bit-exact: only power-of-two ratios.
    fp32_tolerance = 1e-4 if case == "rslora_with_patterns" else 1e-5
    assert (_logits(served) - trainer_logits).abs().max() <= fp32_tolerance
    # In float64 only the adapters' math differs, not the forward's rounding.
    assert (_logits(served.double()) - _logits(as_trained.double())).abs().max() <= 1e-5
    # What PEFT itself computes once loaded: one scale, lora_alpha / r, on every module.
    layers = _lora_layers(served)
    assert len(layers) == len(normalized.modules)
    assert {layer.scaling["default"] for layer in layers.values()} == {cfg.lora_alpha / cfg.r}


def test_uniform_rslora_keeps_b_bit_for_bit() -> None:
    """One scale everywhere: it becomes the global lora_alpha / r, and no tensor is touched."""
    adapter = export(make_peft_model(make_tiny_model(), r=8, alpha=16, use_rslora=True))
    normalized = normalize_scaling(adapter)
    assert normalized.config.lora_alpha / normalized.config.r == adapter.config.scale_for(adapter.modules[0])
    assert all(torch.equal(normalized.pair(m)[1], adapter.pair(m)[1]) for m in adapter.modules)


def test_engine_safe_adapter_is_returned_unchanged() -> None:
    adapter = export(make_peft_model(make_tiny_model(), r=8, alpha=16))
    assert adapter.engine_safe_scaling
    assert normalize_scaling(adapter) is adapter


def test_overlapping_patterns_resolve_like_peft() -> None:
    """lorasync's per-module values equal the scale PEFT's own layers use in the trainer."""
    trainer = make_peft_model(make_tiny_model(), r=8, alpha=16, **CASES["overlapping_patterns"])
    config = export(trainer).config
    for name, layer in _lora_layers(trainer).items():
        module = name.removeprefix("base_model.model.")
        assert config.rank_for(module) == layer.r["default"], module
        assert config.scale_for(module) == layer.scaling["default"], module


def test_saved_overlapping_patterns_round_trip_through_adapter_load(tmp_path: Path) -> None:
    adapter = export(make_peft_model(make_tiny_model(), r=8, alpha=16, **CASES["overlapping_patterns"]))
    adapter.save(tmp_path)
    loaded = Adapter.load(tmp_path)
    for module in adapter.modules:
        assert loaded.config.rank_for(module) == adapter.config.rank_for(module)
        assert loaded.config.scale_for(module) == adapter.config.scale_for(module)
        assert torch.equal(loaded.delta(module), adapter.delta(module))
