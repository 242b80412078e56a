"""Adapter: validation, content hash, PEFT on-disk round trips and typed errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lorasync import Adapter, AdapterConfig
from lorasync.errors import (
    AdapterError,
    ConfigError,
    DtypeMismatchError,
    ExportError,
    InvalidKeyError,
    MissingPairError,
    NonFiniteError,
    ShapeMismatchError,
    StorageError,
    UnknownAdapterNameError,
)
from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model, make_tiny_model

Q = "model.layers.0.self_attn.q_proj"
V = "model.layers.0.self_attn.v_proj"
DOWN = "model.layers.1.mlp.down_proj"


def key(module: str, side: str) -> str:
    return f"base_model.model.{module}.lora_{side}.weight"


def make_tensors(r: int = 4, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Values are small multiples of 1/8, exact in bf16/fp16, so dtype round trips are exact."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {Q: (32, 32), V: (16, 32), DOWN: (32, 64)}  # module: (out, in)
    out: dict[str, torch.Tensor] = {}
    for module, (o, i) in shapes.items():
        out[key(module, "A")] = (torch.randint(-16, 16, (r, i), generator=gen) / 8).to(dtype)
        out[key(module, "B")] = (torch.randint(-16, 16, (o, r), generator=gen) / 8).to(dtype)
    return out


CONFIG = AdapterConfig(r=4, lora_alpha=8)


@pytest.fixture
def adapter() -> Adapter:
    return Adapter(make_tensors(), CONFIG)


# -- content hash ---------------------------------------------------------------------------


def test_hash_is_independent_of_dict_order(adapter: Adapter) -> None:
    reordered = Adapter(dict(reversed(list(make_tensors().items()))), CONFIG)
    assert list(reordered.tensors) == list(adapter.tensors)  # canonical (sorted) order
    assert reordered.content_hash == adapter.content_hash


def test_hash_is_independent_of_device_and_layout(adapter: Adapter) -> None:
    assert adapter.to(device="cpu").content_hash == adapter.content_hash
    strided = {k: t.t().contiguous().t() for k, t in make_tensors().items()}  # same values, transposed strides
    assert not all(t.is_contiguous() for t in strided.values())
    assert Adapter(strided, CONFIG).content_hash == adapter.content_hash


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_hash_follows_dtype(adapter: Adapter, dtype: torch.dtype) -> None:
    cast = adapter.to(dtype=dtype)
    assert cast.content_hash != adapter.content_hash
    # The values are exact in every dtype, so casting back restores the very same adapter.
    assert cast.to(dtype=torch.float32).content_hash == adapter.content_hash


def test_hash_changes_when_any_single_value_changes(adapter: Adapter) -> None:
    for name in adapter.tensors:
        tensors = {k: t.clone() for k, t in adapter.tensors.items()}
        flat = tensors[name].view(-1)
        flat[-1] = torch.nextafter(flat[-1], torch.tensor(float("inf")))  # one ulp, last element
        assert Adapter(tensors, CONFIG).content_hash != adapter.content_hash, name


@pytest.mark.parametrize(
    "changes",
    [
        {"lora_alpha": 16},
        {"use_rslora": True},
        {"base_model_name_or_path": "tiny-llama"},
        {"alpha_pattern": {"q_proj": 4}},
    ],
)
def test_hash_changes_with_config(adapter: Adapter, changes: dict[str, Any]) -> None:
    assert Adapter(dict(adapter.tensors), CONFIG.with_(**changes)).content_hash != adapter.content_hash


def test_hash_treats_equal_configs_alike(adapter: Adapter) -> None:
    # lora_alpha 8 and 8.0 are one config to PEFT and to ==; they must be one hash too.
    same = Adapter(dict(adapter.tensors), CONFIG.with_(lora_alpha=8.0))
    assert same.config == adapter.config
    assert same.content_hash == adapter.content_hash


def test_hash_distinguishes_pattern_order(adapter: Adapter) -> None:
    # PEFT takes the first matching pattern, so the order is part of the meaning.
    first = CONFIG.with_(alpha_pattern={"q_proj": 4, Q: 2})
    second = CONFIG.with_(alpha_pattern={Q: 2, "q_proj": 4})
    assert first.scale_for(Q) == 1.0 and second.scale_for(Q) == 0.5
    tensors = dict(adapter.tensors)
    assert Adapter(tensors, first).content_hash != Adapter(tensors, second).content_hash


# -- PEFT on-disk format ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_round_trip_is_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    adapter = Adapter(make_tensors(dtype=dtype), CONFIG.with_(base_model_name_or_path="tiny"))
    adapter.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = Adapter.load(tmp_path)
    assert loaded.config == adapter.config
    assert list(loaded.tensors) == list(adapter.tensors)
    for name, tensor in adapter.tensors.items():
        assert loaded.tensors[name].dtype == dtype
        assert torch.equal(loaded.tensors[name], tensor), name
    assert loaded.content_hash == adapter.content_hash


@pytest.fixture(scope="module")
def peft_model() -> Any:
    return make_peft_model(make_tiny_model(), r=8, alpha=16)


def test_peft_saved_directory_loads(tmp_path: Path, peft_model: Any) -> None:
    from peft import get_peft_model_state_dict

    peft_model.save_pretrained(str(tmp_path))
    loaded = Adapter.load(tmp_path)
    expected = get_peft_model_state_dict(peft_model)
    assert set(loaded.tensors) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded.tensors[name], tensor), name
    assert (loaded.config.r, loaded.config.lora_alpha) == (8, 16)
    assert loaded.content_hash == export(peft_model).content_hash


def test_peft_saved_named_adapter_with_regex_targets_loads(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from lorasync.testing import randomize_lora

    model = get_peft_model(
        make_tiny_model(),
        LoraConfig(r=4, lora_alpha=8, target_modules=r".*layers\.1\.self_attn\.(q|v)_proj"),
        adapter_name="policy",
    )
    randomize_lora(model, seed=5)
    model.save_pretrained(str(tmp_path))  # a non-default adapter goes to a subdirectory
    loaded = Adapter.load(tmp_path / "policy")
    assert loaded.modules == ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj")
    assert loaded.config.target_modules == ("q_proj", "v_proj")  # derived; a regex is no leaf list
    expected = get_peft_model_state_dict(model, adapter_name="policy")
    assert all(torch.equal(loaded.tensors[k], t) for k, t in expected.items())


def test_delta_matches_peft(peft_model: Any) -> None:
    adapter = export(peft_model)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        layer = peft_model.base_model.model.get_submodule(name)
        torch.testing.assert_close(adapter.delta(name), layer.get_delta_weight("default"), rtol=0, atol=0)


def test_load_missing_files_is_a_storage_error(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="adapter_model.safetensors"):
        Adapter.load(tmp_path)


def test_load_rejects_non_lora_tensors_naming_them(tmp_path: Path, adapter: Adapter) -> None:
    from safetensors.torch import save_file

    adapter.save(tmp_path)
    tensors = dict(adapter.tensors)
    tensors["base_model.model.model.embed_tokens.weight"] = torch.zeros(8, 32)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(InvalidKeyError, match=r"base_model\.model\.model\.embed_tokens\.weight"):
        Adapter.load(tmp_path)


def test_load_refuses_modules_to_save(tmp_path: Path, adapter: Adapter) -> None:
    adapter.save(tmp_path)
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "modules_to_save": ["lm_head"]}))
    with pytest.raises(ConfigError, match="modules_to_save"):
        Adapter.load(tmp_path)


# -- bad input: typed errors naming the offending key ------------------------------------------


def _without(name: str) -> dict[str, torch.Tensor]:
    tensors = make_tensors()
    del tensors[name]
    return tensors


def _with(name: str, value: Any) -> dict[str, torch.Tensor]:
    tensors = make_tensors()
    tensors[name] = value
    return tensors


def _poison(name: str, value: float) -> dict[str, torch.Tensor]:
    tensors = make_tensors()
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] = value
    return tensors


BAD_INPUTS = {
    "missing B": (_without(key(V, "B")), CONFIG, MissingPairError, key(V, "B")),
    "missing A": (_without(key(Q, "A")), CONFIG, MissingPairError, key(Q, "A")),
    "A rank != r": (_with(key(Q, "A"), torch.zeros(2, 32)), CONFIG, ShapeMismatchError, Q),
    "B rank != r": (_with(key(DOWN, "B"), torch.zeros(32, 8)), CONFIG, ShapeMismatchError, DOWN),
    "3-D factor": (_with(key(V, "A"), torch.zeros(1, 4, 32)), CONFIG, ShapeMismatchError, key(V, "A")),
    "r in config != tensors": (make_tensors(), CONFIG.with_(r=8), ShapeMismatchError, Q),
    "mixed dtypes": (
        _with(key(V, "B"), torch.zeros(16, 4, dtype=torch.bfloat16)),
        CONFIG,
        DtypeMismatchError,
        key(V, "B"),
    ),
    "integer tensor": (
        _with(key(Q, "B"), torch.zeros(32, 4, dtype=torch.int64)),
        CONFIG,
        DtypeMismatchError,
        key(Q, "B"),
    ),
    "embed_tokens": (
        _with("model.embed_tokens.weight", torch.zeros(8, 32)),
        CONFIG,
        InvalidKeyError,
        "model.embed_tokens.weight",
    ),
    "PEFT-prefixed embed_tokens": (
        _with("base_model.model.model.embed_tokens.weight", torch.zeros(8, 32)),
        CONFIG,
        InvalidKeyError,
        "base_model.model.model.embed_tokens.weight",
    ),
    "adapter segment left in": (
        _with("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight", torch.zeros(4, 32)),
        CONFIG,
        InvalidKeyError,
        "lora_A.default.weight",
    ),
    "not a tensor": (_with(key(Q, "A"), [[0.0] * 32] * 4), CONFIG, AdapterError, key(Q, "A")),
    "target_modules miss a module": (
        make_tensors(),
        CONFIG.with_(target_modules=("q_proj", "v_proj")),
        ShapeMismatchError,
        DOWN,
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_typed_error_naming_the_key(case: str) -> None:
    tensors, config, error, named = BAD_INPUTS[case]
    with pytest.raises(error) as info:
        Adapter(tensors, config)
    assert named in str(info.value)
    assert isinstance(info.value, ValueError)  # callers may catch the builtin


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_raise_only_when_checked(value: float) -> None:
    tensors = _poison(key(DOWN, "B"), value)
    Adapter(tensors, CONFIG)  # default: no data pass
    with pytest.raises(NonFiniteError) as info:
        Adapter(tensors, CONFIG, check_finite=True)
    assert key(DOWN, "B") in str(info.value)
    assert info.value.key == key(DOWN, "B")


def test_empty_adapter_is_refused() -> None:
    with pytest.raises(AdapterError, match="at least one lora_A/lora_B pair"):
        Adapter({}, CONFIG)


def test_unknown_adapter_on_model_export_lists_available(peft_model: Any) -> None:
    with pytest.raises(UnknownAdapterNameError) as info:
        export(peft_model, adapter_name="policy")
    assert "'policy'" in str(info.value) and "['default']" in str(info.value)
    assert info.value.adapter == "policy"


def test_unknown_adapter_on_state_dict_export_lists_available() -> None:
    state = {
        f"module.base_model.model.{m}.lora_{s}.{name}.weight": t
        for name in ("actor", "critic")
        for m in (Q,)
        for s, t in (("A", torch.zeros(4, 32)), ("B", torch.zeros(32, 4)))
    }
    with pytest.raises(UnknownAdapterNameError) as info:
        export(state, adapter_name="default", alpha=8)
    assert "'default'" in str(info.value) and "['actor', 'critic']" in str(info.value)
    # The adapters that are there export cleanly, each without the other's weights.
    assert export(state, adapter_name="critic", alpha=8).modules == (Q,)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"r": 8, "lora_alpha": 16, "use_dora": True}, "DoRA"),
        ({"r": 8, "lora_alpha": 16, "bias": "all"}, "bias"),
        ({"r": 0, "lora_alpha": 16}, "r must be a positive int"),
        ({"r": 8, "lora_alpha": float("nan")}, "lora_alpha must be a finite number"),
        ({"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 0}}, r"rank_pattern\['q_proj'\]"),
    ],
)
def test_config_refuses_unservable_settings(data: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        AdapterConfig.from_peft(data)


def test_state_dict_export_with_a_missing_factor_names_it() -> None:
    state = {f"module.base_model.model.{Q}.lora_B.default.weight": torch.zeros(32, 4)}
    with pytest.raises(MissingPairError) as info:
        export(state, alpha=8)
    assert key(Q, "A") in str(info.value)


def _fake(shape: tuple[int, ...]) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.zeros(shape)


UNMATERIALISED = {
    "meta": (lambda shape: torch.zeros(shape, device="meta"), "meta"),
    "fake": (_fake, "FakeTensor"),
    "sparse": (lambda shape: torch.zeros(shape).to_sparse(), "to_dense"),
}


@pytest.mark.parametrize("case", list(UNMATERIALISED))
def test_tensors_without_data_are_refused_at_construction(case: str) -> None:
    # Issue 33 item 16: a meta tensor built an Adapter, then the first hash or write raised an
    # untyped RuntimeError deep in a publish. Construction is where it must stop, naming the fix.
    make, words = UNMATERIALISED[case]
    tensors = make_tensors()
    tensors[key(V, "B")] = make(tuple(tensors[key(V, "B")].shape))
    with pytest.raises(AdapterError) as info:
        Adapter(tensors, CONFIG)
    assert key(V, "B") in str(info.value) and words in str(info.value)
    assert info.value.key == key(V, "B")


def test_exporting_a_model_built_on_the_meta_device_is_a_typed_error() -> None:
    # The way a trainer gets meta tensors: a model built under torch.device("meta") (or
    # init_empty_weights) whose weights were never loaded.
    with torch.device("meta"):
        model = make_peft_model(make_tiny_model())
    with pytest.raises((AdapterError, ExportError), match="meta"):
        export(model)
