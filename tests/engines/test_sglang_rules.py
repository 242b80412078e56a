"""SGLang's adapter rules in one place: the publisher's ``check_adapter``, the client's
pre-flight, the disk route and ``lorasync inspect`` all give the same verdict.

No server: the rules need none (the contract-peer end-to-end test is in test_sglang.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lorasync import Adapter, AdapterConfig
from lorasync._keys import peft_key
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
