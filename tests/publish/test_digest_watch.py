"""The torn-read watch reads every tensor's version counter in one pass; an adapter that mixes
inference-mode tensors (no counter) with trained ones is still watched on the trained ones."""

from __future__ import annotations

import torch

from lorasync import Adapter, AdapterConfig
from lorasync._digest import PublishDigest


def _adapter(first: torch.Tensor) -> Adapter:
    tensors = {
        "base_model.model.layer.q_proj.lora_A.weight": first,
        "base_model.model.layer.q_proj.lora_B.weight": torch.zeros(8, 2),
    }
    return Adapter(tensors, AdapterConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))


def test_an_in_place_write_is_seen_beside_an_inference_mode_tensor():
    with torch.inference_mode():
        frozen = torch.ones(2, 8)
    adapter = _adapter(frozen)
    digest = PublishDigest(adapter)
    assert digest.changed() is None
    adapter.tensors["base_model.model.layer.q_proj.lora_B.weight"].add_(1)
    assert digest.changed() == "an in-place write to them"


def test_a_watch_over_trained_tensors_sees_each_write():
    adapter = _adapter(torch.ones(2, 8))
    digest = PublishDigest(adapter)
    adapter.tensors["base_model.model.layer.q_proj.lora_A.weight"].mul_(2)
    assert digest.changed() == "an in-place write to them"
    assert PublishDigest(adapter).changed() is None
