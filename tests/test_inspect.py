"""``lorasync inspect``: loader rules of PEFT, vLLM and SGLang, read from config and header only."""

import json

import torch

from lorasync import Adapter, AdapterConfig
from lorasync.cli import main
from lorasync.inspection import inspect_adapter


def _save(tmp_path, r=8, **cfg):
    m = "model.layers.0.self_attn"
    tensors = {}
    for leaf in ("q_proj", "v_proj"):
        tensors[f"base_model.model.{m}.{leaf}.lora_A.weight"] = torch.zeros(r, 64)
        tensors[f"base_model.model.{m}.{leaf}.lora_B.weight"] = torch.zeros(64, r)
    return Adapter(tensors, AdapterConfig(r=r, lora_alpha=16, **cfg)).save(tmp_path / "a")


def test_clean_adapter_loads_everywhere(tmp_path, capsys):
    path = _save(tmp_path)
    result = inspect_adapter(path, vllm_max_rank=16)
    assert [result.verdict(e) for e in ("peft", "vllm", "sglang")] == ["loads"] * 3
    assert result.rank == 8 and result.nbytes == 4 * 8 * 64 * 4
    assert main(["inspect", str(path)]) == 0
    assert "vllm    loads" in capsys.readouterr().out


def test_rank_rslora_patterns_and_extra_files_are_reported(tmp_path):
    path = _save(tmp_path, r=32, use_rslora=True)
    (path / "other.safetensors").write_bytes((path / "adapter_model.safetensors").read_bytes())
    result = inspect_adapter(path, vllm_max_rank=16)
    assert result.verdict("vllm") == "refused"
    assert result.verdict("sglang") == "refused"  # extra safetensors files
    assert any("ignores use_rslora" in f.message for f in result.findings)


def test_dora_and_bad_keys(tmp_path):
    path = _save(tmp_path)
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    from safetensors.torch import save_file

    save_file({"base_model.model.model.embed_tokens.weight": torch.zeros(4, 4)}, str(path / "adapter_model.safetensors"))
    result = inspect_adapter(path)
    messages = " ".join(f.message for f in result.findings)
    assert "DoRA" in messages and "no LoRA weight key" in messages
    assert main(["inspect", str(path)]) == 1
