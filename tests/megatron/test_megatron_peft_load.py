"""The exported adapter loads in PEFT on the tiny model and reproduces the original adapter's logits."""

from __future__ import annotations

import json

import pytest
import torch
from _shard_builder import build_shards

from lorasync.exporters.megatron import export
from lorasync.testing import make_peft_model


def _base(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


# transformers 5 deprecation raised inside PEFT, not by lorasync
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_exported_adapter_reproduces_peft_logits(tiny_model_dir, tmp_path):
    from peft import PeftModel, get_peft_model_state_dict

    reference = make_peft_model(_base(tiny_model_dir), r=8, alpha=16)
    # Fused Megatron LoRA shares one lora_A across q/k/v and across gate/up: give the reference that.
    with torch.no_grad():
        for name, module in reference.named_modules():
            for shared, copies in (("q_proj", ("k_proj", "v_proj")), ("gate_proj", ("up_proj",))):
                if name.endswith(shared):
                    parent = reference.get_submodule(name.rsplit(".", 1)[0])
                    for other in copies:
                        getattr(parent, other).lora_A["default"].weight.copy_(module.lora_A["default"].weight)
    source = {k: v.detach().clone() for k, v in get_peft_model_state_dict(reference).items()}
    cfg = json.loads((tiny_model_dir / "config.json").read_text())

    shards = build_shards(source, cfg, tp=2, pp=2, max_rank=16, prefix="module.")
    adapter = export(shards, base_config=tiny_model_dir, alpha=16, rank=8)
    out = adapter.save(tmp_path / "adapter")

    loaded = PeftModel.from_pretrained(_base(tiny_model_dir), str(out)).eval()
    ids = torch.tensor([[1, 17, 42, 99, 256, 300, 7, 511]])
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
        plain = _base(tiny_model_dir)(input_ids=ids).logits
    assert (got - expected).abs().max().item() <= 1e-5
    assert (plain - expected).abs().max().item() > 1e-2  # the adapter is not a no-op
