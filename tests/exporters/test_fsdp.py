"""lorasync.exporters.fsdp.export under real torch.distributed wrappers (gloo, 2 CPU processes).

One spawn runs every wrapping variant (FSDP1 with and without ``use_orig_params``, FSDP2
``fully_shard``, activation checkpointing, ``torch.compile``, DDP). Every rank exports (the
export is a collective), rank 0 saves the Adapter and the trainer's logits; the tests below then
check, per variant, that every rank produced the very Adapter the unwrapped PEFT model exports,
and that PEFT loading the saved directory on a fresh base reproduces the trainer's logits.
"""

from __future__ import annotations

import functools
import json
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from support import run_distributed
from lorasync import Adapter
from lorasync.errors import MissingPairError, PaddedRankError, UnknownAdapterNameError
from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model, make_tiny_model, randomize_lora

# Variant → the decorations its parameter names must carry (proof the wrapper really applied).
VARIANTS: dict[str, tuple[str, ...]] = {
    "fsdp1": ("_fsdp_wrapped_module.", "_flat_param"),
    "fsdp1_orig_params": ("_fsdp_wrapped_module.", ".lora_A.default._fsdp_wrapped_module.weight"),
    "fsdp1_checkpoint": ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_flat_param"),
    "fsdp2": (".lora_A.default.weight",),
    "fsdp2_checkpoint_compile": ("_orig_mod.", "_checkpoint_wrapped_module."),
    "ddp": ("module.base_model.model.",),
    "ddp_compile": ("_orig_mod.module.base_model.model.",),
}


def _peft_model() -> Any:
    """The trainer's model: tiny GQA Llama + random LoRA "default" on all linears + a second,
    inactive adapter "other" whose weights must never leak into "default"'s export."""
    from peft import LoraConfig

    model = make_peft_model(make_tiny_model())
    model.add_adapter("other", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    randomize_lora(model, seed=2)
    return model.eval()


def _input_ids() -> torch.Tensor:
    return torch.randint(4, 512, (2, 12), generator=torch.Generator().manual_seed(0))


def _is_layer(module: nn.Module) -> bool:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return isinstance(module, LlamaDecoderLayer)


def _checkpoint(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    apply_activation_checkpointing(model, check_fn=_is_layer)


def _fsdp1(model: nn.Module, *, use_orig_params: bool) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    # verl's LoRA policy: every decoder layer, plus every leaf with a trainable weight (each
    # active lora_A/lora_B Linear) as its own unit, so wrapper segments appear inside
    # "lora_A.default." and the inactive adapter shares a flat parameter with base weights.
    def trainable_leaf(module: nn.Module) -> bool:
        weight = getattr(module, "weight", None)
        return not list(module.children()) and isinstance(weight, nn.Parameter) and weight.requires_grad

    policy = functools.partial(
        _or_policy,
        policies=[
            functools.partial(lambda_auto_wrap_policy, lambda_fn=trainable_leaf),
            functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}),
        ],
    )
    return FSDP(model, auto_wrap_policy=policy, use_orig_params=use_orig_params, device_id=torch.device("cpu"))


def _fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.base_model.model.model.layers:  # a decoder layer or its checkpoint wrapper
        fully_shard(layer)
    fully_shard(model)
    return model


def _wrap(variant: str, model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    if variant == "fsdp1":
        return _fsdp1(model, use_orig_params=False)
    if variant == "fsdp1_orig_params":
        return _fsdp1(model, use_orig_params=True)
    if variant == "fsdp1_checkpoint":  # llama-recipes order: shard first, then checkpoint layers
        wrapped = _fsdp1(model, use_orig_params=False)
        _checkpoint(wrapped)
        return wrapped
    if variant == "fsdp2":
        return _fsdp2(model)
    if variant == "fsdp2_checkpoint_compile":  # torchtitan order: checkpoint, shard, compile
        _checkpoint(model)
        return torch.compile(_fsdp2(model), backend="eager")
    if variant == "ddp":
        return DDP(model)
    if variant == "ddp_compile":
        return torch.compile(DDP(model), backend="eager")
    raise AssertionError(variant)


def _worker(rank: int, world_size: int, out: str) -> None:
    """Runs on every rank. Every rank exports every variant (collectives need all of them).
    A variant that fails is recorded with its traceback and the next one runs, so one broken
    wrapper fails its own tests only (a rank-divergent failure hits the gloo timeout instead)."""
    results: dict[str, Any] = {}
    for variant in VARIANTS:
        try:
            results[variant] = _run_variant(rank, variant, Path(out, variant))
        except Exception:
            results[variant] = {"error": traceback.format_exc()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def _run_variant(rank: int, variant: str, out: Path) -> dict[str, Any]:
    from safetensors.torch import save_file

    model = _wrap(variant, _peft_model())
    record: dict[str, Any] = {"names": [n for n, _ in model.named_parameters()]}
    if variant in ("fsdp2", "fsdp1"):
        # Before any forward: parameters are sharded (DTensor / flat shards).
        record["hash_before_forward"] = export(model).content_hash
    # A compiled module (backend="eager") computes what its _orig_mod computes; calling the
    # latter skips ~10 s of dynamo tracing. The export still sees the "_orig_mod." names.
    forward = getattr(model, "_orig_mod", model)
    with torch.no_grad():
        logits = forward(input_ids=_input_ids()).logits
    adapter = export(model)
    record["hash"] = adapter.content_hash
    record["other_hash"] = export(model, adapter_name="other").content_hash
    # Refusals happen identically on every rank, so no rank is left inside a collective;
    # the exports that follow (this and later variants) prove the group stayed usable.
    try:
        export(model, adapter_name="nope")
    except UnknownAdapterNameError as exc:
        record["unknown"] = {"type": type(exc).__name__, "message": str(exc), "adapter": exc.adapter}
    try:
        export(model, rank=4)  # the random LoRA uses all 8 ranks: nothing to trim
    except PaddedRankError as exc:
        record["padded"] = {"type": type(exc).__name__, "key": exc.key}
    if rank == 0:
        adapter.save(out / "adapter")
        save_file({"logits": logits.contiguous()}, str(out / "logits.safetensors"))
    return record


def _results(dist_run: dict[str, Any], variant: str) -> list[dict[str, Any]]:
    """Every rank's record for ``variant``; fails with the worker's traceback if it raised."""
    records = [ranks[variant] for ranks in dist_run["ranks"]]
    for rank, record in enumerate(records):
        if "error" in record:
            pytest.fail(f"{variant} failed on rank {rank}:\n{record['error']}", pytrace=False)
    return records


@pytest.fixture(scope="module")
def dist_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run every variant once on 2 gloo ranks; per-rank results plus rank 0's files."""
    out = tmp_path_factory.mktemp("fsdp-export")
    run_distributed(_worker, str(out), world_size=2, timeout_s=240)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {"out": out, "ranks": ranks}


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """Hashes the plain, unwrapped PEFT model exports (the truth every wrapper must match)."""
    model = _peft_model()
    return {"default": export(model).content_hash, "other": export(model, adapter_name="other").content_hash}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_names_carry_the_variant_decorations(dist_run: dict[str, Any], variant: str) -> None:
    names = _results(dist_run, variant)[0]["names"]
    for decoration in VARIANTS[variant]:
        assert any(decoration in n for n in names), (decoration, names[:5])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_rank_exports_the_unwrapped_adapter(
    dist_run: dict[str, Any], reference: dict[str, str], variant: str
) -> None:
    # Same hash as the unwrapped model: same keys, shapes, dtype, bytes and config.
    for rank, record in enumerate(_results(dist_run, variant)):
        assert record["hash"] == reference["default"], f"rank {rank}"
        assert record["other_hash"] == reference["other"], f"rank {rank}"
        if "hash_before_forward" in record:
            assert record["hash_before_forward"] == reference["default"], f"rank {rank}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_saved_adapter_reproduces_trainer_logits(dist_run: dict[str, Any], variant: str) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    rank0 = _results(dist_run, variant)[0]
    directory = dist_run["out"] / variant
    trainer_logits = load_file(str(directory / "logits.safetensors"))["logits"]
    base = make_tiny_model()
    with torch.no_grad():
        base_logits = base(input_ids=_input_ids()).logits
        served = PeftModel.from_pretrained(base, str(directory / "adapter")).eval()
        served_logits = served(input_ids=_input_ids()).logits
    # The LoRA really moves the logits, so the equality below cannot pass by accident.
    assert (trainer_logits - base_logits).abs().max() > 1e-2
    assert (served_logits - trainer_logits).abs().max() <= 1e-5
    loaded = Adapter.load(directory / "adapter")
    assert loaded.content_hash == rank0["hash"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_refusals_are_raised_on_every_rank(dist_run: dict[str, Any], variant: str) -> None:
    for record in _results(dist_run, variant):
        unknown = record["unknown"]
        assert unknown["type"] == "UnknownAdapterNameError"
        assert unknown["adapter"] == "nope"
        assert "'nope'" in unknown["message"]
        assert "['default', 'other']" in unknown["message"]
        assert record["padded"]["type"] == "PaddedRankError"
        assert record["padded"]["key"].startswith("model.layers.")


def test_decorated_state_dict_exports_like_the_model() -> None:
    """A decorated FSDP1-style mapping (no process group) exports like the model itself."""
    model = _peft_model()
    decorated = {
        "_fsdp_wrapped_module." + name.replace("layers.0.", "layers.0._fsdp_wrapped_module."): p.detach()
        for name, p in model.named_parameters()
    }
    adapter = export(decorated, alpha=16)
    assert adapter.content_hash == export(model).content_hash



@pytest.mark.parametrize("bad", [["default"], {"default": 1}, {"default"}, None, 0, ""])
def test_an_adapter_name_that_is_no_name_is_a_typed_refusal(bad: object) -> None:
    # A list (or set, dict) raised an untyped TypeError from the key cache (outside attack).
    from lorasync.errors import ConfigError

    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(4, 16),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight": torch.zeros(16, 4),
    }
    with pytest.raises(ConfigError, match="adapter_name"):
        export(tensors, adapter_name=bad, alpha=8)  # type: ignore[arg-type]


def test_the_export_walk_sees_what_torch_named_parameters_sees() -> None:
    """export walks the module tree once, in its own loop: it must find every LoRA factor under
    the very name and in the order torch's ``named_parameters()`` gives, with a module reached
    twice (shared), a tied LoRA factor, a removed (None) submodule and parameter, and a module
    whose LoRA factors were replaced after the model was built."""
    from lorasync.exporters.fsdp import _walk

    model = make_peft_model(make_tiny_model(seed=3), r=4)
    randomize_lora(model, seed=1)
    layers = model.base_model.model.model.layers
    layers[1].self_attn.shared_mlp = layers[0].mlp  # one module under two names: listed once, first name
    layers[0].self_attn.q_proj.lora_A["default"].weight = layers[0].self_attn.k_proj.lora_A["default"].weight  # tied
    layers[1].mlp.register_module("gone", None)
    layers[1].mlp.register_parameter("nothing", None)
    fresh = nn.Linear(layers[1].mlp.up_proj.in_features, 4, bias=False)
    layers[1].mlp.up_proj.lora_A["default"] = fresh  # replaced after the model was built
    want = [(name, id(p)) for name, p in model.named_parameters() if "lora_" in name]
    assert [(name, id(p)) for name, p in _walk(model).lora] == want
    # Tied, k_proj's factor is listed once, under q_proj's name (as torch lists it): a typed refusal.
    with pytest.raises(MissingPairError, match="k_proj"):
        export(model)
    layers[0].self_attn.q_proj.lora_A["default"].weight = nn.Parameter(layers[0].self_attn.k_proj.lora_A["default"].weight.detach().clone())
    exported = export(model)
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"
    assert exported.tensors[key].data_ptr() == fresh.weight.data_ptr()  # the replacement, no copy
    assert len(exported.tensors) == len([n for n, _ in model.named_parameters() if "lora_" in n])


def _hide_children(model: Any) -> None:
    attn = model.base_model.model.model.layers[0].self_attn

    class HidesChildren(type(attn)):  # type: ignore[misc]
        def named_modules(self, memo=None, prefix="", remove_duplicate=True):  # noqa: ANN001, ANN202
            memo = set() if memo is None else memo
            if self not in memo:
                memo.add(self)
                yield prefix, self  # its children are its own business: not listed

    attn.__class__ = HidesChildren


def _equal_by_value(model: Any) -> None:
    layers = model.base_model.model.model.layers
    q0 = layers[0].self_attn.q_proj

    class ByValue(type(q0)):  # type: ignore[misc]
        def __eq__(self, other: object) -> bool:
            return type(other) is type(self)

        def __hash__(self) -> int:
            return 1

    for layer in layers[:2]:
        layer.self_attn.q_proj.__class__ = ByValue  # named_modules() keeps the first of two "equal" modules


class _LenZero(dict):
    def __len__(self) -> int:
        return 0  # a proxy that reports only materialised entries


def _falsy_parameters(model: Any) -> None:
    lora_a = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"]
    object.__setattr__(lora_a, "_parameters", _LenZero(lora_a._parameters))


def _falsy_modules(model: Any) -> None:
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    object.__setattr__(q, "_modules", _LenZero(q._modules))


def _mapping_modules(model: Any) -> None:
    from collections.abc import MutableMapping

    class Table(MutableMapping):  # type: ignore[type-arg]
        def __init__(self, d: dict) -> None:
            self.d = dict(d)

        def __getitem__(self, k: str) -> Any:
            return self.d[k]

        def __setitem__(self, k: str, v: Any) -> None:
            self.d[k] = v

        def __delitem__(self, k: str) -> None:
            del self.d[k]

        def __iter__(self):  # noqa: ANN204
            return iter(self.d)

        def __len__(self) -> int:
            return len(self.d)

    layer = model.base_model.model.model.layers[0]
    object.__setattr__(layer, "_modules", Table(layer._modules))


@pytest.mark.parametrize("tweak", [_hide_children, _equal_by_value, _falsy_parameters, _falsy_modules, _mapping_modules], ids=lambda f: f.__name__.strip("_"))
def test_export_lists_what_torch_lists_for_modules_that_change_the_walk(tweak: Any) -> None:
    """Modules that override or replace torch's own plumbing (found by an outside attack on the
    faster walk, which read ``_modules`` itself): export takes what ``named_parameters()`` lists,
    under the same names, the trainer's own tensors, never a crash or a silently dropped factor."""
    from lorasync.adapter._keys import normalize_trainer_key

    model = make_peft_model(make_tiny_model(seed=3), r=4)
    randomize_lora(model, seed=1)
    tweak(model)
    want = {normalize_trainer_key(n): p.data_ptr() for n, p in model.named_parameters() if "lora_" in n}
    exported = export(model)
    assert {k: t.data_ptr() for k, t in exported.tensors.items()} == want
