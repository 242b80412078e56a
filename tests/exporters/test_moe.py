"""MoE LoRA from PEFT ``target_parameters`` (transformers-5 fused experts) to the PEFT engine, exact.

A tiny random Qwen3-MoE (lorasync.testing.make_tiny_moe_model: 2 layers, 4 experts, top-2) with a
PEFT LoRA on attention (``target_modules``), the fused experts and the router
(``target_parameters``). ``fsdp.export`` and ``Adapter.load`` turn it into one LoRA per expert;
the PEFT engine fuses it back and must compute exactly what HF+PEFT computes: the same greedy
tokens, log-probs within 1e-5 (fp32), also through the merged fallback (against PEFT's own merge).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lorasync import Adapter, BaseWeights, Publisher
from lorasync.adapter._moe import LAYOUT, fuse, split
from lorasync.engines import connect
from lorasync.errors import ExpertLayoutError, PaddedRankError
from lorasync.exporters.fsdp import export
from lorasync.testing import make_moe_peft_model, make_tiny_moe_model

PROMPTS = ([5, 17, 99, 230, 41], [300, 12, 7], [64, 65, 66, 67, 68, 69])
NEW_TOKENS = 6
LAYER0 = "model.layers.0.mlp.experts"


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before, _ = torch.get_num_threads(), torch.set_num_threads(1)  # tiny tensors, a busy 2-core box
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-moe")
    make_tiny_moe_model(path)
    return path


def fresh(base_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def trained(base_dir: Path) -> Any:
    return make_moe_peft_model(fresh(base_dir), r=8, alpha=16, seed=3, std=0.1)


def reference(model: Any, prompt: list[int], n: int = NEW_TOKENS) -> tuple[list[int], list[float]]:
    """Greedy tokens of ``model`` and each one's log-prob from one forward over prompt + tokens
    (how the PEFT engine scores them)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)
        tokens = out[0, len(prompt) :].tolist()
        rows = torch.log_softmax(model(input_ids=out[:, :-1]).logits[0].float(), -1)[len(prompt) - 1 :]
    return tokens, [float(rows[i, t]) for i, t in enumerate(tokens)]


def wrappers(model: Any, layer: int = 0) -> tuple[Any, Any]:
    """PEFT's ParamWrappers of one layer's experts: (gate_up_proj, down_proj)."""
    outer = model.base_model.model.model.layers[layer].mlp.experts
    return outer.base_layer, outer


# -- the conversion ------------------------------------------------------------------------------


def test_export_gives_one_lora_per_expert_with_peft_deltas(trained: Any) -> None:
    adapter = export(trained)
    experts = [m for m in adapter.modules if ".mlp.experts." in m]
    assert len(experts) == 2 * 4 * 3  # layers x experts x {gate, up, down}
    assert {"model.layers.0.mlp.gate", "model.layers.1.self_attn.q_proj"} <= set(adapter.modules)
    gate_up, down = wrappers(trained)
    d_gate_up, d_down = gate_up.get_delta_weight("default"), down.get_delta_weight("default")
    for e in range(4):
        gate, up = adapter.delta(f"{LAYER0}.{e}.gate_proj"), adapter.delta(f"{LAYER0}.{e}.up_proj")
        assert torch.equal(torch.cat([gate, up]), d_gate_up[e])
        assert torch.equal(adapter.delta(f"{LAYER0}.{e}.down_proj"), d_down[e])
        a_gate, _ = adapter.pair(f"{LAYER0}.{e}.gate_proj")
        assert tuple(a_gate.shape) == (8, 128) and adapter.pair(f"{LAYER0}.{e}.down_proj")[1].shape == (128, 8)
    router = trained.base_model.model.model.layers[0].mlp.gate
    assert torch.equal(adapter.delta("model.layers.0.mlp.gate"), router.get_delta_weight("default"))
    assert adapter.config.r == 8 and adapter.config.lora_alpha == 16 and not adapter.config.rank_pattern


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_adapter_load_of_peft_save_equals_export(trained: Any, tmp_path: Path, task_type: str | None) -> None:
    trained.peft_config["default"].task_type = task_type
    try:
        trained.save_pretrained(tmp_path / "peft")
    finally:
        trained.peft_config["default"].task_type = None
    saved = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert saved["target_parameters"]
    # PEFT names the base class only without a task_type; otherwise the caller names the family.
    model_type = None if task_type is None else "qwen3_moe"
    loaded = Adapter.load(tmp_path / "peft", model_type=model_type)
    assert loaded.content_hash == export(trained).content_hash
    if task_type is not None:
        with pytest.raises(ExpertLayoutError, match="model_type=") as info:
            Adapter.load(tmp_path / "peft")
        assert info.value.parameter.endswith("mlp.experts.down_proj") or info.value.parameter.endswith("gate_up_proj")


def test_state_dict_export_with_its_peft_config(trained: Any) -> None:
    state = {n: p for n, p in trained.named_parameters() if "lora_" in n}
    got = export(state, config=trained.peft_config["default"], model_type="qwen3_moe")
    assert got.content_hash == export(trained).content_hash


def test_per_parameter_ranks_and_alphas_are_kept(base_dir: Path) -> None:
    model = make_moe_peft_model(
        fresh(base_dir), r=8, alpha=16, seed=4, rank_pattern={"mlp.experts.down_proj": 4}, alpha_pattern={"gate_up_proj": 4.0}
    )
    gate_up, down = wrappers(model)
    assert (gate_up.r["default"], gate_up.lora_alpha["default"], down.r["default"]) == (8, 4.0, 4)
    adapter = export(model)
    cfg = adapter.config
    assert cfg.rank_for(f"{LAYER0}.2.down_proj") == 4 and cfg.scale_for(f"{LAYER0}.2.down_proj") == 16 / 4
    assert cfg.rank_for(f"{LAYER0}.2.up_proj") == 8 and cfg.scale_for(f"{LAYER0}.2.up_proj") == 4 / 8
    assert cfg.scale_for("model.layers.0.self_attn.q_proj") == 2.0
    for e in range(4):
        assert torch.equal(adapter.delta(f"{LAYER0}.{e}.down_proj"), down.get_delta_weight("default")[e])
    engine = connect("peft", model=fresh(base_dir))
    engine.load_adapter_tensors("ranked", adapter)
    for prompt in PROMPTS:
        tokens, logprobs = engine.greedy("ranked", list(prompt), NEW_TOKENS)
        want_tokens, want_logprobs = reference(model, list(prompt))
        assert tokens == want_tokens and logprobs == pytest.approx(want_logprobs, abs=1e-5)


def test_max_rank_padding_is_trimmed_per_expert(base_dir: Path) -> None:
    """A MultiLoRA-style slot: trained at rank 8 inside rank-16 factors whose padding is zero
    (per expert: rows 8.. of each expert's A block, columns 8.. of its B block)."""
    model = make_moe_peft_model(fresh(base_dir), r=16, alpha=32, seed=5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name and "lora_A" in name:
                param.view(4, 16, -1)[:, 8:].zero_()
            elif ".experts." in name and "lora_B" in name:
                param.view(param.shape[0], 16, 4)[:, 8:].zero_()
            elif "lora_A" in name:
                param[8:].zero_()
            elif "lora_B" in name:
                param[:, 8:].zero_()
    full = export(model)
    trimmed = export(model, rank=8, alpha=16)  # the slot's real rank and alpha: the same scale
    dense = [m for m in full.modules if ".experts." not in m]
    fused = [f"model.layers.{i}.mlp.experts.{r.param}" for i in (0, 1) for r in LAYOUT]
    by_fused = export(model, rank={**{m: 8 for m in dense}, **{p: 8 for p in fused}}, alpha=16)
    assert by_fused.content_hash == trimmed.content_hash
    for module in full.modules:
        assert trimmed.pair(module)[0].shape[0] == 8
        assert torch.allclose(trimmed.delta(module), full.delta(module), rtol=0, atol=1e-6), module
    with pytest.raises(PaddedRankError):
        export(model, rank=4, alpha=8)


# -- the PEFT engine serves it -------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["disk", "ipc"])
def test_peft_engine_serves_hf_peft_tokens(trained: Any, base_dir: Path, tmp_path: Path, transport: str) -> None:
    engine = connect("peft", base_model_path=base_dir)
    with Publisher([engine], name="moe", transport=transport, root=tmp_path) as publisher:
        report = publisher.publish(export(trained), version=1).raise_for_errors()
    for prompt in PROMPTS:
        tokens, logprobs = engine.greedy(report.served_name, list(prompt), NEW_TOKENS)
        want_tokens, want_logprobs = reference(trained, list(prompt))
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-5)
    # ... and the adapter makes a difference a broken conversion could not hide.
    assert any(engine.greedy(None, list(p), NEW_TOKENS)[0] != reference(trained, list(p))[0] for p in PROMPTS)


@pytest.mark.parametrize("layout", ["checkpoint", "fused"])
def test_merged_equals_peft_merge(trained: Any, base_dir: Path, tmp_path: Path, layout: str) -> None:
    """``checkpoint``: the base read from disk, per-expert names (the PEFT engine writes their rows
    of its fused parameters); ``fused``: the trainer's own transformers-5 tensors."""
    engine = connect("peft", base_model_path=base_dir)
    base = BaseWeights.from_pretrained(base_dir) if layout == "checkpoint" else BaseWeights.from_tensors(fresh(base_dir).state_dict())
    merged = copy.deepcopy(trained).merge_and_unload()
    with Publisher([engine], name="moe", transport="merged", root=tmp_path, base=base) as publisher:
        publisher.publish(export(trained), version=1).raise_for_errors()
        served = engine.model.state_dict()
        for name, tensor in merged.state_dict().items():
            assert torch.allclose(served[name], tensor, rtol=0, atol=1e-6), name
        for prompt in PROMPTS:
            tokens, logprobs = engine.greedy(None, list(prompt), NEW_TOKENS)
            want_tokens, want_logprobs = reference(merged, list(prompt))
            assert tokens == want_tokens and logprobs == pytest.approx(want_logprobs, abs=1e-5)
        # A second version without expert LoRA gives the experts their pristine weights back.
        plain = make_moe_peft_model(fresh(base_dir), experts=False, router=False, seed=9)
        publisher.publish(export(plain), version=2).raise_for_errors()
        pristine = fresh(base_dir).state_dict()
        assert torch.equal(engine.model.state_dict()[f"{LAYER0}.gate_up_proj"], pristine[f"{LAYER0}.gate_up_proj"])


# -- refusals ----------------------------------------------------------------------------------


def test_an_unknown_expert_layout_is_refused_naming_the_parameter(trained: Any) -> None:
    state = {n: p for n, p in trained.named_parameters() if "lora_" in n}
    with pytest.raises(ExpertLayoutError, match="gpt_oss") as info:
        export(state, config=trained.peft_config["default"], model_type="gpt_oss")
    assert info.value.parameter == "model.layers.0.mlp.experts.gate_up_proj"


def test_fused_factors_without_their_config_are_refused(trained: Any) -> None:
    state = {n: p for n, p in trained.named_parameters() if "lora_" in n}
    with pytest.raises(ExpertLayoutError, match="target_parameters") as info:
        export(state, alpha=16)
    assert info.value.parameter.endswith("mlp.experts.base_layer")


def test_a_target_parameter_no_engine_serves_is_refused(base_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(fresh(base_dir), LoraConfig(r=4, lora_alpha=8, target_parameters=["model.embed_tokens.weight"]))
    with pytest.raises(ExpertLayoutError, match="cannot serve as LoRA") as info:
        export(model)
    assert info.value.parameter == "model.embed_tokens.weight"


def test_shapes_that_do_not_split_are_refused(trained: Any, tmp_path: Path) -> None:
    trained.save_pretrained(tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    config["r"] = 3  # 32 rows of A are not experts x 3
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ExpertLayoutError, match="not a multiple of its rank 3"):
        Adapter.load(tmp_path / "peft")


# -- the layout's two directions -----------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(LAYOUT), st.integers(1, 5), st.integers(1, 4), st.integers(1, 6), st.integers(1, 3), st.integers(0, 2**16))
def test_fuse_inverts_split_bit_for_bit(rule: Any, experts: int, rank: int, inputs: int, rows: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(experts * rank, inputs, generator=g)
    b = torch.randn(rows * len(rule.leaves), rank * experts, generator=g)
    parts = split(rule, a, b, experts, path="p")
    a2, b2 = fuse(rule, parts, experts)
    assert torch.equal(a2, a) and torch.equal(b2, b)
    # Each expert's delta is PEFT's: B.view(out, r, E)[..., e] @ A.view(E, r, in)[e]. Its factors
    # are compared bit for bit (a float matmul of a strided view and of a contiguous copy may round
    # differently, so equal factors are the exact check), each leaf owning its block of rows.
    for e in range(experts):
        a_e = a.view(experts, rank, inputs)[e]
        b_e = b.view(b.shape[0], rank, experts)[:, :, e]
        for k, leaf in enumerate(rule.leaves):
            leaf_a, leaf_b = parts[(e, leaf)]
            assert torch.equal(leaf_a, a_e) and torch.equal(leaf_b, b_e[k * rows : (k + 1) * rows])
        got = torch.cat([parts[(e, leaf)][1].double() @ parts[(e, leaf)][0].double() for leaf in rule.leaves])
        assert torch.allclose(got, b_e.double() @ a_e.double(), rtol=0, atol=1e-12)


def test_fuse_of_distinct_leaf_factors_stacks_ranks_exactly() -> None:
    """CanonicalLoRA-style experts (gate and up with their own A, ranks differing between experts):
    fused block-diagonally and zero-padded, every per-expert product unchanged."""
    rule = LAYOUT[0]
    g = torch.Generator().manual_seed(0)
    parts = {}
    for e, r in enumerate((2, 3)):
        for leaf in rule.leaves:
            parts[(e, leaf)] = (torch.randn(r, 5, generator=g), torch.randn(4, r, generator=g))
    a, b = fuse(rule, parts, 2)
    assert tuple(a.shape) == (2 * 6, 5) and tuple(b.shape) == (8, 6 * 2)
    back = split(rule, a, b, 2, path="p")
    for (e, leaf), (pa, pb) in parts.items():
        assert torch.allclose(back[(e, leaf)][1] @ back[(e, leaf)][0], pb @ pa, atol=1e-6)
