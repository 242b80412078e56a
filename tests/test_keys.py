"""PEFT key building/parsing and trainer-name normalisation (lorasync.adapter._keys)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorasync.adapter._keys import is_embedding_key, normalize_trainer_key, parse_peft_key, peft_key, split_saved_key
from lorasync.errors import InvalidKeyError

WRAPPERS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
# Segments with a meaning to the normaliser never appear inside generated module paths.
RESERVED = {"module", "base_model", "modules_to_save", "original_module", "default"}

identifiers = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True).filter(lambda s: s not in RESERVED)
segments = st.one_of(identifiers, st.integers(0, 99).map(str))
# A module path starts like a real one ("model.layers.3...", "lm_head", "transformer.h.0...").
module_paths = st.builds(lambda head, rest: [head, *rest], identifiers, st.lists(segments, max_size=5))
adapter_names = identifiers
sides = st.sampled_from(["A", "B"])


@st.composite
def decorate(draw: st.DrawFn, body: list[str]) -> str:
    """``body`` with random trainer decorations: wrapper segments between any two segments
    (also inside ``lora_A.<name>.``, as verl's per-leaf FSDP units do), an optional PEFT prefix
    and leading DDP ``module.`` / compile ``_orig_mod.`` repeats."""
    if draw(st.booleans()):
        body = ["base_model", "model", *body]
    out: list[str] = []
    for segment in body:
        out += draw(st.lists(st.sampled_from(WRAPPERS), max_size=2))
        out.append(segment)
    leading = draw(st.lists(st.sampled_from(["module", "_orig_mod"]), max_size=3))
    return ".".join([*leading, *out])


@st.composite
def lora_names(draw: st.DrawFn) -> tuple[str, str, str, str]:
    """(decorated name, adapter name, module, side) of one LoRA weight of that adapter."""
    module = draw(module_paths)
    side = draw(sides)
    adapter = draw(adapter_names)
    # PEFT model names carry the adapter segment; saved/NeMo names do not.
    tail = [f"lora_{side}", adapter, "weight"] if draw(st.booleans()) else [f"lora_{side}", "weight"]
    return draw(decorate([*module, *tail])), adapter, ".".join(module), side


@st.composite
def non_lora_names(draw: st.DrawFn) -> tuple[str, str]:
    """(decorated name, adapter name) of something that is not a LoRA weight of that adapter."""
    adapter = draw(adapter_names)
    other = draw(adapter_names.filter(lambda a: a != adapter))
    module = draw(module_paths)
    side = draw(sides)
    body = draw(
        st.sampled_from(
            [
                [*module, f"lora_{side}", other, "weight"],  # another adapter's LoRA weight
                [*module, "base_layer", "weight"],  # PEFT's wrapped base linear
                [*module, "weight"],  # a plain base weight
                [*module, f"lora_{side}", adapter, "bias"],  # LoRA bias (lora_bias=True)
                [*module, "modules_to_save", adapter, "weight"],  # a full module copy
                [*module, "original_module", "weight"],
                [*module, f"lora_embedding_{side}", other],  # another adapter's embedding LoRA
                ["model", "embed_tokens", "weight"],
                ["model", "embed_tokens", "base_layer", "weight"],
                ["lm_head", "weight"],
                ["lm_head", "modules_to_save", adapter, "weight"],
                [*module, "_flat_param"],  # FSDP1 flat parameter
            ]
        )
    )
    return draw(decorate(body)), adapter


@settings(max_examples=200, deadline=None)
@given(lora_names())
def test_normalize_recovers_module_and_side(case: tuple[str, str, str, str]) -> None:
    name, adapter, module, side = case
    assert normalize_trainer_key(name, adapter) == peft_key(module, side)  # type: ignore[arg-type]


@st.composite
def embedding_names(draw: st.DrawFn) -> tuple[str, str, str, str]:
    """(decorated name, adapter name, module, side) of one embedding LoRA factor: PEFT keeps
    ``lora_embedding_A/B`` in a ParameterDict (``...lora_embedding_A.<adapter>``, saved without it)."""
    module = draw(module_paths)
    side = draw(sides)
    adapter = draw(adapter_names)
    tail = [f"lora_embedding_{side}", adapter] if draw(st.booleans()) else [f"lora_embedding_{side}"]
    return draw(decorate([*module, *tail])), adapter, ".".join(module), side


@settings(max_examples=200, deadline=None)
@given(embedding_names())
def test_normalize_keeps_embedding_factors(case: tuple[str, str, str, str]) -> None:
    # Regression (issue 28 item 6): these were dropped, so an embed_tokens LoRA went unserved.
    name, adapter, module, side = case
    key = normalize_trainer_key(name, adapter)
    assert key == f"base_model.model.{module}.lora_embedding_{side}"
    assert key == peft_key(module, side, embedding=True)  # type: ignore[arg-type]
    assert parse_peft_key(key) == (module, side) and is_embedding_key(key)
    assert split_saved_key(key) == (module, side, None)
    assert split_saved_key(f"{key}.{adapter}") == (module, side, adapter)


@settings(max_examples=200, deadline=None)
@given(lora_names(), adapter_names)
def test_normalize_is_idempotent(case: tuple[str, str, str, str], any_adapter: str) -> None:
    name, adapter, _, _ = case
    canonical = normalize_trainer_key(name, adapter)
    assert canonical is not None
    # The canonical key carries no adapter segment: it normalises to itself for any adapter.
    assert normalize_trainer_key(canonical, adapter) == canonical
    assert normalize_trainer_key(canonical, any_adapter) == canonical
    assert peft_key(*parse_peft_key(canonical)) == canonical and not is_embedding_key(canonical)


@settings(max_examples=200, deadline=None)
@given(non_lora_names())
def test_normalize_never_keeps_non_lora_or_other_adapter_keys(case: tuple[str, str]) -> None:
    name, adapter = case
    assert normalize_trainer_key(name, adapter) is None


@pytest.mark.parametrize(
    ("name", "adapter", "expected"),
    [
        # FSDP1 named_parameters (use_orig_params=True), verl's per-leaf units.
        (
            "_fsdp_wrapped_module.base_model.model.model.layers.0._fsdp_wrapped_module.self_attn.q_proj"
            ".lora_A.default._fsdp_wrapped_module.weight",
            "default",
            ("model.layers.0.self_attn.q_proj", "A"),
        ),
        # torch.compile + activation checkpointing + FSDP2 (plain names).
        (
            "_orig_mod.base_model.model.model.layers.1._checkpoint_wrapped_module.mlp.down_proj.lora_B.default.weight",
            "default",
            ("model.layers.1.mlp.down_proj", "B"),
        ),
        # DDP around a PEFT model with a named adapter.
        (
            "module.base_model.model.model.layers.0.self_attn.v_proj.lora_B.policy.weight",
            "policy",
            ("model.layers.0.self_attn.v_proj", "B"),
        ),
        # NeMo Automodel LinearLoRA names: no PEFT prefix, no adapter segment.
        ("model.layers.5.self_attn.q_proj.lora_A.weight", "default", ("model.layers.5.self_attn.q_proj", "A")),
        # The PEFT on-disk key itself.
        (
            "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight",
            "default",
            ("model.layers.0.mlp.up_proj", "A"),
        ),
        # Another adapter, base weights, embeddings, flat params, modules_to_save: dropped.
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.other.weight", "default", None),
        ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "default", None),
        ("model.embed_tokens.weight", "default", None),
        ("base_model.model.model.embed_tokens.weight", "default", None),
        ("base_model.model.lm_head.modules_to_save.default.weight", "default", None),
        ("_fsdp_wrapped_module.base_model.model.model.layers.0._fsdp_wrapped_module._flat_param", "default", None),
        ("lora_A.weight", "default", None),
    ],
)
def test_normalize_known_trainer_names(name: str, adapter: str, expected: tuple[str, str] | None) -> None:
    assert normalize_trainer_key(name, adapter) == (peft_key(*expected) if expected else None)  # type: ignore[misc]


@settings(max_examples=200, deadline=None)
@given(module_paths, sides)
def test_peft_key_round_trips(module: list[str], side: str) -> None:
    path = ".".join(module)
    key = peft_key(path, side)  # type: ignore[arg-type]
    assert key == f"base_model.model.{path}.lora_{side}.weight"
    assert parse_peft_key(key) == (path, side)


@pytest.mark.parametrize(
    "key",
    [
        "model.embed_tokens.weight",
        "base_model.model.model.embed_tokens.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_C.weight",
        "base_model.model..lora_A.weight",
        "base_model.model.model.layers.0/../x.lora_A.weight",
        "model.layers.0.self_attn.q_proj.lora_A.weight",  # lacks the PEFT prefix
    ],
)
def test_parse_rejects_non_peft_keys_naming_them(key: str) -> None:
    with pytest.raises(InvalidKeyError) as info:
        parse_peft_key(key)
    assert repr(key) in str(info.value)
    assert info.value.key == key


@pytest.mark.parametrize("module", ["", "a..b", "../etc", "a/b", "layers.0 ", "x.lora_A.weight\n"])
def test_peft_key_rejects_unsafe_module_paths(module: str) -> None:
    with pytest.raises(InvalidKeyError, match="cannot form a PEFT key"):
        peft_key(module, "A")
