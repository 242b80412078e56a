"""SGLang's adapter rules in one place: the publisher's ``check_adapter``, the client's
pre-flight, the disk route and ``lorasync inspect`` all give the same verdict.

No server: the rules need none (the contract-peer end-to-end test is in test_sglang.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lorasync import Adapter, AdapterConfig
from lorasync.adapter._keys import peft_key
from lorasync.engines._engine import Capabilities
from lorasync.engines._hosts import is_same_host
from lorasync.engines.sglang import SGLangEngine
from lorasync.errors import IncompatibleAdapterError
from lorasync.inspection import inspect_adapter

CAPS = Capabilities(engine="sglang", url="http://127.0.0.1:30000", max_rank=64, tensor_load=True)


def _adapter(leaves: tuple[str, ...], r: int = 4, **config: Any) -> Adapter:
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(2):
        for leaf in leaves:
            group = "mlp" if leaf in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            module = f"model.layers.{layer}.{group}.{leaf}"
            rank = config.get("rank_pattern", {}).get(module, r)
            tensors[peft_key(module, "A")] = torch.randn(rank, 32, generator=gen)
            tensors[peft_key(module, "B")] = torch.randn(32, rank, generator=gen)
    return Adapter(tensors, AdapterConfig(r=r, lora_alpha=config.pop("lora_alpha", 2 * r), **config))


SHAPES = {
    "qv": (_adapter(("q_proj", "v_proj")), None),
    "qkvo+mlp": (_adapter(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")), None),
    "q only": (_adapter(("q_proj",)), "v_proj"),
    "k v": (_adapter(("k_proj", "v_proj")), "q_proj"),
    "up only": (_adapter(("q_proj", "v_proj", "up_proj")), "gate_proj"),
    "rslora": (_adapter(("q_proj", "v_proj"), use_rslora=True), "normalize_scaling"),
    "alpha pattern": (_adapter(("q_proj", "v_proj"), alpha_pattern={"q_proj": 1.0}), "normalize_scaling"),
}


@pytest.mark.parametrize("which", sorted(SHAPES))
def test_check_adapter_refuses_what_sglang_cannot_serve(which: str) -> None:
    adapter, missing = SHAPES[which]
    engine = SGLangEngine("http://127.0.0.1:30000")
    if missing is None:
        engine.check_adapter(adapter, CAPS)
        return
    with pytest.raises(IncompatibleAdapterError, match=missing) as info:
        engine.check_adapter(adapter, CAPS)
    assert info.value.engine == "sglang"


@pytest.mark.parametrize("which", sorted(SHAPES))
def test_inspection_agrees_with_the_client(which: str, tmp_path: Path) -> None:
    """``lorasync inspect`` refuses or warns exactly where the client refuses (the gate/up rule
    included, which inspection used to miss)."""
    adapter, missing = SHAPES[which]
    result = inspect_adapter(adapter.save(tmp_path / "a"))
    sglang = [f for f in result.findings if f.engine == "sglang"]
    if missing is None:
        assert result.verdict("sglang") == "loads", sglang
    else:
        assert result.verdict("sglang") != "loads"
        assert any(missing in f.message for f in sglang), sglang


def test_mixed_ranks_pass_for_tensors_and_are_refused_on_the_disk_route(tmp_path: Path) -> None:
    pattern = {"model.layers.0.self_attn.q_proj": 2}
    adapter = _adapter(("q_proj", "v_proj"), r=4, rank_pattern=pattern, alpha_pattern={m: 4.0 for m in pattern}, lora_alpha=8)
    engine = SGLangEngine("http://127.0.0.1:30000")
    engine.check_adapter(adapter, CAPS)  # the tensor route pads them exactly
    path = adapter.save(tmp_path / "mixed")
    op = engine._load_op("mixed@v1", str(path), False)
    with pytest.raises(IncompatibleAdapterError, match="pad_ranks"):
        next(op)  # refused before the first request is built
    result = inspect_adapter(path)
    assert result.verdict("sglang") == "loads with caveats"
    assert any("pad_ranks" in f.message for f in result.findings if f.engine == "sglang")


@pytest.mark.parametrize(
    ("url", "local"),
    [
        ("http://127.0.0.1:8000", True),
        ("http://localhost:8000", True),
        ("http://[::1]:8000", True),
        ("http://0.0.0.0:8000", True),
        ("http://gpu-node-3:8000", False),
        ("https://10.0.0.7", False),
    ],
)
def test_one_same_host_rule(url: str, local: bool) -> None:
    assert is_same_host(url) is local
    assert is_same_host(url, override=not local) is (not local)
    assert SGLangEngine(url).same_host is local
    assert SGLangEngine(url, same_host=not local).same_host is (not local)


@pytest.mark.parametrize(
    "config",
    [
        {"use_rslora": True},
        {"alpha_pattern": {"model.layers.0.self_attn.q_proj": 1.0}},
    ],
    ids=["rslora", "alpha pattern"],
)
def test_the_disk_route_refuses_a_saved_adapter_sglang_would_scale_wrong(config: dict[str, Any], tmp_path: Path) -> None:
    """SGLang scales every module by lora_alpha / r and ignores use_rslora and alpha_pattern, so
    ``load_adapter(name, dir)`` refuses such a directory before the first request is built (the
    publisher's check_adapter refuses the Adapter; this is the direct call)."""
    path = _adapter(("q_proj", "v_proj"), r=16, lora_alpha=16, **config).save(tmp_path / "a")
    op = SGLangEngine("http://127.0.0.1:30000")._load_op("a@v1", str(path), False)
    with pytest.raises(IncompatibleAdapterError, match="normalize_scaling"):
        next(op)


def test_an_rslora_adapter_at_rank_one_scales_alike_and_loads(tmp_path: Path) -> None:
    """alpha / sqrt(1) == alpha / 1: nothing to refuse on the disk route."""
    path = _adapter(("q_proj", "v_proj"), r=1, lora_alpha=2, use_rslora=True).save(tmp_path / "a")
    op = SGLangEngine("http://127.0.0.1:30000")._load_op("a@v1", str(path), False)
    assert next(op).path == "/load_lora_adapter"


def test_normalize_scaling_converts_rslora_exactly_for_sglang() -> None:
    """rsLoRA scales by alpha / sqrt(r), SGLang by alpha / r (sqrt(r) times weaker: 4x at r=16).
    The conversion the refusal names keeps every tensor bit for bit and sets lora_alpha so
    SGLang's alpha' / r is PEFT's alpha / sqrt(r) exactly; the result passes SGLang's rules."""
    from lorasync.transforms import normalize_scaling

    rslora = _adapter(("q_proj", "v_proj"), r=16, lora_alpha=16, use_rslora=True)
    peft_scale = 16 / 16**0.5
    assert rslora.config.scale_for(rslora.modules[0]) == peft_scale == 4.0
    converted = normalize_scaling(rslora)
    assert not converted.config.use_rslora
    assert converted.config.lora_alpha / converted.config.r == peft_scale  # SGLang's scale, exactly
    assert converted.tensors.keys() == rslora.tensors.keys()
    assert all(torch.equal(converted.tensors[k], rslora.tensors[k]) for k in rslora.tensors)
    SGLangEngine("http://127.0.0.1:30000").check_adapter(converted, CAPS)
    with pytest.raises(IncompatibleAdapterError, match="normalize_scaling"):
        SGLangEngine("http://127.0.0.1:30000").check_adapter(rslora, CAPS)
