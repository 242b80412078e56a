"""The in-process PEFT engine: exact numerics against the original PEFT model, hot-swap,
rollback of failed loads, tensor loads and in-place base weight updates."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lorasync import Adapter, AdapterConfig
from lorasync.adapter._keys import peft_key
from lorasync.engines import Capabilities, connect
from lorasync.engines.peft import PeftEngine
from lorasync.errors import (
    AdapterAlreadyLoadedError,
    AdapterNotFoundError,
    AdapterRejectedError,
    CapacityError,
    ConfigError,
    EngineError,
    IncompatibleAdapterError,
    RankTooLargeError,
)
from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model

PROMPT = [1, 17, 42, 99, 311, 5, 250]


def _base(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def _trained(tiny_model_dir: Path, seed: int, **lora: Any) -> Any:
    """The trainer's PEFT model: tiny base plus random (trained-looking) LoRA on every linear."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers deprecation inside PEFT
        return make_peft_model(_base(tiny_model_dir), seed=seed, **lora)


def _greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by its definition: argmax of a full forward, one token at a time."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _logprobs(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)


def _lora_params(engine: PeftEngine) -> list[str]:
    return [n for n, _ in engine.model.named_parameters() if ".lora_" in n]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Any:
    # Tiny matmuls: on a busy 2-core box, a second intra-op thread makes them ~40x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def policy(_one_torch_thread: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two trained PEFT models, their lorasync exports on disk, and reference outputs."""
    out: dict[str, Any] = {}
    for tag, seed in (("v1", 3), ("v2", 4)):
        model = _trained(tiny_model_dir, seed)
        adapter = export(model)
        out[tag] = {
            "model": model,
            "adapter": adapter,
            "dir": adapter.save(tmp_path_factory.mktemp(f"adapter-{tag}")),
            "tokens": _greedy(model, PROMPT, 8),
            "logprobs": _logprobs(model, PROMPT),
        }
    base = _base(tiny_model_dir)
    out["base"] = {"model": base, "tokens": _greedy(base, PROMPT, 8), "logprobs": _logprobs(base, PROMPT)}
    return out


@pytest.fixture
def engine(tiny_model_dir: Path) -> PeftEngine:
    return PeftEngine(base_model_path=tiny_model_dir)


# -- construction ---------------------------------------------------------------------------


def test_connect_finds_the_peft_engine_with_a_path_a_url_or_a_model(tiny_model_dir: Path) -> None:
    by_option = connect("peft", base_model_path=tiny_model_dir)
    by_url = connect("peft", str(tiny_model_dir))
    by_model = connect("peft", model=_base(tiny_model_dir))
    for engine in (by_option, by_url, by_model):
        assert isinstance(engine, PeftEngine)
        assert engine.list_adapters() == []
    assert by_url.url == str(tiny_model_dir)
    assert by_url.generate(PROMPT) == by_model.generate(PROMPT)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"model": "/a", "base_model_path": "/b"}, {"max_loras": 0}, {"max_rank": -1}, {"max_loras": True}],
    ids=["nothing", "both", "max_loras=0", "max_rank<0", "max_loras=True"],
)
def test_bad_options_raise_config_error(tiny_model_dir: Path, kwargs: dict[str, Any]) -> None:
    if any(k.startswith("max_") for k in kwargs):
        kwargs = {"base_model_path": tiny_model_dir, **kwargs}  # only the limit is wrong
    with pytest.raises(ConfigError):
        PeftEngine(**kwargs)


def test_a_path_without_a_checkpoint_raises_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no transformers checkpoint"):
        PeftEngine(base_model_path=tmp_path)


def test_capabilities_state_everything_and_the_limits(tiny_model_dir: Path) -> None:
    caps = PeftEngine(base_model_path=tiny_model_dir, max_loras=3, max_rank=16).capabilities()
    assert caps == Capabilities(
        engine="peft",
        url=str(tiny_model_dir),
        lora=True,
        runtime_lora=True,
        max_rank=16,
        max_loras=3,
        tensor_load=True,
        weight_update=True,
        load_inplace=True,
        same_host=True,
        in_process=True,
    )


# -- numerics -------------------------------------------------------------------------------


def test_exported_adapter_reproduces_the_trainers_peft_model(engine: PeftEngine, policy: dict[str, Any]) -> None:
    engine.load_adapter("policy@v1", policy["v1"]["dir"])

    assert engine.generate(PROMPT, adapter="policy@v1", max_new_tokens=8) == policy["v1"]["tokens"]
    got = engine.logprobs(PROMPT, adapter="policy@v1")
    assert got.shape == (len(PROMPT), 512) and got.dtype == torch.float32
    assert torch.allclose(got, policy["v1"]["logprobs"], atol=1e-5, rtol=0)
    # adapter=None is the base model, untouched by the loaded adapter
    assert policy["v1"]["tokens"] != policy["base"]["tokens"]
    assert engine.generate(PROMPT, max_new_tokens=8) == policy["base"]["tokens"]
    assert torch.allclose(engine.logprobs(PROMPT), policy["base"]["logprobs"], atol=1e-5, rtol=0)


def test_tensor_load_equals_disk_load(engine: PeftEngine, policy: dict[str, Any]) -> None:
    engine.load_adapter("disk", policy["v1"]["dir"])
    engine.load_adapter_tensors("tensors", policy["v1"]["adapter"])

    assert torch.equal(engine.logprobs(PROMPT, adapter="tensors"), engine.logprobs(PROMPT, adapter="disk"))
    assert engine.generate(PROMPT, adapter="tensors") == policy["v1"]["tokens"]


def test_tensor_load_as_first_adapter_serves_the_trainers_outputs(engine: PeftEngine, policy: dict[str, Any]) -> None:
    engine.load_adapter_tensors("policy", policy["v2"]["adapter"])
    assert engine.generate(PROMPT, adapter="policy") == policy["v2"]["tokens"]
    assert torch.allclose(engine.logprobs(PROMPT, adapter="policy"), policy["v2"]["logprobs"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain-base", "under-peft"])
def test_merged_weights_give_the_adapters_logits(
    engine: PeftEngine, policy: dict[str, Any], tiny_model_dir: Path, wrapped: bool
) -> None:
    """W0 + s·B·A written with update_weights serves what the adapter serves, whether or not
    PEFT currently wraps the modules (then the weight lives at ``...base_layer.weight``)."""
    if wrapped:
        engine.load_adapter("other", policy["v2"]["dir"])
    adapter: Adapter = policy["v1"]["adapter"]
    pristine = dict(_base(tiny_model_dir).named_parameters())
    merged = {f"{m}.weight": pristine[f"{m}.weight"].detach() + adapter.delta(m) for m in adapter.modules}
    assert len(merged) == 14

    engine.update_weights(merged)

    assert torch.allclose(engine.logprobs(PROMPT), policy["v1"]["logprobs"], atol=1e-4, rtol=0)
    assert engine.generate(PROMPT) == policy["v1"]["tokens"]
    if wrapped:  # the loaded adapter now applies on top of the new base weights
        engine.unload_adapter("other")
        assert torch.allclose(engine.logprobs(PROMPT), policy["v1"]["logprobs"], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("name", "shape", "error"),
    [
        ("model.layers.0.self_attn.q_proj.weight", (256, 128), AdapterRejectedError),
        ("model.layers.0.self_attn.nope.weight", (256, 256), IncompatibleAdapterError),
        ("model.layers.9.self_attn.q_proj.weight", (256, 256), IncompatibleAdapterError),
    ],
    ids=["bad-shape", "unknown-module", "unknown-layer"],
)
def test_a_bad_weight_update_changes_nothing(
    engine: PeftEngine, policy: dict[str, Any], name: str, shape: tuple[int, int], error: type[Exception]
) -> None:
    before = engine.logprobs(PROMPT)
    good = {"model.layers.0.mlp.up_proj.weight": torch.zeros(512, 256)}
    with pytest.raises(error):
        engine.update_weights({**good, name: torch.zeros(shape)})  # the good one comes first
    assert torch.equal(engine.logprobs(PROMPT), before)


# -- hot swap and failures ----------------------------------------------------------------------


def test_hot_swap_keeps_the_other_adapter_serving(engine: PeftEngine, policy: dict[str, Any]) -> None:
    engine.load_adapter("policy@v1", policy["v1"]["dir"])
    v1_before = engine.logprobs(PROMPT, adapter="policy@v1")

    engine.load_adapter("policy@v2", policy["v2"]["dir"])
    assert engine.list_adapters() == ["policy@v1", "policy@v2"]
    assert torch.equal(engine.logprobs(PROMPT, adapter="policy@v1"), v1_before)
    assert engine.generate(PROMPT, adapter="policy@v2") == policy["v2"]["tokens"]

    engine.unload_adapter("policy@v1")
    assert engine.list_adapters() == ["policy@v2"]
    assert engine.generate(PROMPT, adapter="policy@v2") == policy["v2"]["tokens"]
    with pytest.raises(AdapterNotFoundError):
        engine.generate(PROMPT, adapter="policy@v1")

    engine.unload_adapter("policy@v2")
    assert _lora_params(engine) == []  # the original modules are back
    assert torch.allclose(engine.logprobs(PROMPT), policy["base"]["logprobs"], atol=1e-5, rtol=0)


def _module_adapter(module: str, in_features: int, out_features: int) -> Adapter:
    tensors = {peft_key(module, "A"): torch.ones(4, in_features), peft_key(module, "B"): torch.ones(out_features, 4)}
    return Adapter(tensors, AdapterConfig(r=4, lora_alpha=8))


def _broken(kind: str, directory: Path, policy: dict[str, Any]) -> Path:
    if kind == "corrupt-weights":
        policy["v2"]["adapter"].save(directory)
        (directory / "adapter_model.safetensors").write_bytes(b"\x00not a safetensors file")
        return directory
    if kind == "wrong-shape":  # fails inside PEFT, after the LoRA layers were injected
        return _module_adapter("model.layers.0.self_attn.q_proj", 128, 256).save(directory)
    if kind == "absent-layer":  # PEFT only warns about weights it could not place
        return _module_adapter("model.layers.7.self_attn.q_proj", 256, 256).save(directory)
    assert kind == "absent-module"
    return _module_adapter("model.layers.0.self_attn.c_attn", 256, 256).save(directory)


@pytest.mark.parametrize("first", [False, True], ids=["with-previous", "first-load"])
@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("corrupt-weights", AdapterRejectedError),
        ("wrong-shape", IncompatibleAdapterError),
        ("absent-layer", IncompatibleAdapterError),
        ("absent-module", IncompatibleAdapterError),
    ],
)
def test_a_failed_load_changes_nothing(
    engine: PeftEngine, policy: dict[str, Any], tmp_path: Path, kind: str, error: type[Exception], first: bool
) -> None:
    if not first:
        engine.load_adapter("policy@v1", policy["v1"]["dir"])
    served = engine.logprobs(PROMPT, adapter=None if first else "policy@v1")
    lora_params = _lora_params(engine)

    with pytest.raises(error) as info:
        engine.load_adapter("policy@v2", _broken(kind, tmp_path / "broken", policy))

    assert info.value.adapter == "policy@v2"  # type: ignore[attr-defined]
    assert engine.list_adapters() == ([] if first else ["policy@v1"])
    assert _lora_params(engine) == lora_params  # nothing half-injected is left behind
    assert torch.equal(engine.logprobs(PROMPT, adapter=None if first else "policy@v1"), served)
    # and the name is free for a good adapter
    engine.load_adapter("policy@v2", policy["v2"]["dir"])
    assert engine.generate(PROMPT, adapter="policy@v2") == policy["v2"]["tokens"]


@pytest.mark.parametrize("first", [False, True], ids=["with-previous", "first-load"])
def test_a_failed_tensor_load_changes_nothing(engine: PeftEngine, policy: dict[str, Any], first: bool) -> None:
    if not first:
        engine.load_adapter_tensors("policy@v1", policy["v1"]["adapter"])
    served = engine.logprobs(PROMPT, adapter=None if first else "policy@v1")
    lora_params = _lora_params(engine)

    with pytest.raises(IncompatibleAdapterError, match="size mismatch"):
        engine.load_adapter_tensors("policy@v2", _module_adapter("model.layers.1.mlp.up_proj", 128, 512))

    assert engine.list_adapters() == ([] if first else ["policy@v1"])
    assert _lora_params(engine) == lora_params
    assert torch.equal(engine.logprobs(PROMPT, adapter=None if first else "policy@v1"), served)


def test_duplicate_and_unknown_names(engine: PeftEngine, policy: dict[str, Any]) -> None:
    engine.load_adapter("policy", policy["v1"]["dir"])
    with pytest.raises(AdapterAlreadyLoadedError, match="unload it first"):
        engine.load_adapter("policy", policy["v2"]["dir"])
    with pytest.raises(AdapterAlreadyLoadedError):
        engine.load_adapter_tensors("policy", policy["v2"]["adapter"])
    assert engine.generate(PROMPT, adapter="policy") == policy["v1"]["tokens"]  # still v1
    with pytest.raises(AdapterNotFoundError, match="'ghost'"):
        engine.unload_adapter("ghost")
    with pytest.raises(AdapterNotFoundError):
        engine.load_adapter("ghost", policy["v1"]["dir"].parent / "does-not-exist")


def test_capacity_and_rank_limits(tiny_model_dir: Path, policy: dict[str, Any]) -> None:
    engine = PeftEngine(base_model_path=tiny_model_dir, max_loras=1, max_rank=8)
    engine.load_adapter("a", policy["v1"]["dir"])
    with pytest.raises(CapacityError, match="max_loras=1"):
        engine.load_adapter_tensors("b", policy["v2"]["adapter"])
    assert engine.list_adapters() == ["a"]
    engine.unload_adapter("a")

    rank16 = _trained(tiny_model_dir, seed=5, r=16)
    with pytest.raises(RankTooLargeError):
        engine.load_adapter_tensors("big", export(rank16))
    assert engine.list_adapters() == []


def test_foreign_errors_are_translated(engine: PeftEngine, policy: dict[str, Any]) -> None:
    engine.load_adapter("policy", policy["v1"]["dir"])
    with pytest.raises(EngineError, match="logprobs") as info:
        engine.logprobs([10_000], adapter="policy")  # token id beyond the vocabulary
    assert isinstance(info.value.__cause__, IndexError)
    with pytest.raises(ConfigError):
        engine.generate([])


def test_concurrent_inference_on_different_adapters_matches_sequential(
    engine: PeftEngine, policy: dict[str, Any]
) -> None:
    engine.load_adapter("v1", policy["v1"]["dir"])
    engine.load_adapter("v2", policy["v2"]["dir"])
    results: dict[tuple[str, int], list[int]] = {}

    def worker(name: str) -> None:
        for i in range(3):
            results[(name, i)] = engine.generate(PROMPT, adapter=name, max_new_tokens=4)

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("v1", "v2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (name, _), tokens in results.items():
        assert tokens == policy[name]["tokens"][:4]
    assert len(results) == 6
