"""Merged fold: W0 + s·B·A from the pristine base, bounded buckets, fused groups kept whole."""

import torch

from lorasync import Adapter, AdapterConfig, BaseWeights
from lorasync.transports._fold import fold_buckets

LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj")


def _setup(targets=("q_proj", "o_proj"), dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = {f"model.layers.{i}.self_attn.{l}.weight": torch.randn(64, 64, generator=g).to(dtype) for i in range(3) for l in LEAVES}
    tensors = {}
    for i in range(3):
        for l in targets:
            m = f"model.layers.{i}.self_attn.{l}"
            tensors[f"base_model.model.{m}.lora_A.weight"] = torch.randn(8, 64, generator=g)
            tensors[f"base_model.model.{m}.lora_B.weight"] = torch.randn(64, 8, generator=g)
    return base, Adapter(tensors, AdapterConfig(r=8, lora_alpha=16))


def test_fold_equals_float64_reference_within_bf16():
    base, ad = _setup()
    merged = {}
    for bucket in fold_buckets(ad, BaseWeights.from_tensors(base), bucket_bytes=1 << 30):
        merged.update(bucket)
    assert set(merged) == {f"{m}.weight" for m in ad.modules}
    for m in ad.modules:
        a, b = (t.double() for t in ad.pair(m))
        ref = base[f"{m}.weight"].double() + 2.0 * (b @ a)
        got = merged[f"{m}.weight"]
        assert got.dtype == torch.bfloat16
        assert torch.allclose(got.double(), ref, rtol=1e-2, atol=1e-2)


def test_buckets_bounded_and_fused_groups_whole_and_restore():
    base, ad = _setup(targets=("q_proj",))
    one = 64 * 64 * 2
    buckets = list(
        fold_buckets(ad, BaseWeights.from_tensors(base), bucket_bytes=3 * one, fused=[("q_proj", "k_proj", "v_proj")], restore=["model.layers.0.self_attn.o_proj"])
    )
    names = [set(b) for b in buckets]
    # Each bucket holds whole q/k/v groups; k and v come back pristine.
    for i in range(3):
        group = {f"model.layers.{i}.self_attn.{l}.weight" for l in ("q_proj", "k_proj", "v_proj")}
        assert any(group <= n for n in names)
    assert all(sum(t.numel() * t.element_size() for t in b.values()) <= 3 * one for b in buckets)
    flat = {k: v for b in buckets for k, v in b.items()}
    assert torch.equal(flat["model.layers.1.self_attn.k_proj.weight"], base["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(flat["model.layers.0.self_attn.o_proj.weight"], base["model.layers.0.self_attn.o_proj.weight"])
    assert not torch.equal(flat["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])


def test_fold_never_accumulates():
    base, ad = _setup()
    weights = BaseWeights.from_tensors(base)
    first = {k: v for b in fold_buckets(ad, weights, bucket_bytes=1 << 30) for k, v in b.items()}
    second = {k: v for b in fold_buckets(ad, weights, bucket_bytes=1 << 30) for k, v in b.items()}
    for k in first:
        assert torch.equal(first[k], second[k])


def test_base_weights_from_the_trainers_model_are_the_checkpoint_live(tmp_path):
    """BaseWeights.from_model: the checkpoint's names and values, the model's own tensors (no
    copy), and a fold from them bit for bit the fold from the saved checkpoint."""
    import pytest
    from transformers import AutoModelForCausalLM

    from lorasync.errors import ConfigError
    from lorasync.exporters.fsdp import export
    from lorasync.testing import make_peft_model, make_tiny_model

    make_tiny_model(tmp_path / "base")
    saved = BaseWeights.from_pretrained(tmp_path / "base")
    with_copies = make_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), seed=5, modules_to_save=["lm_head"])
    assert set(BaseWeights.from_model(with_copies)._tensors) == set(saved._files)  # the original lm_head, not its trained copy
    peft = make_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), seed=5)
    live = BaseWeights.from_model(peft)
    assert set(live._tensors) == set(saved._files)  # every base weight under its checkpoint name, nothing else
    for name in saved._files:
        assert torch.equal(live.get(name), saved.get(name)), name
    q = "model.layers.0.self_attn.q_proj"
    assert live.get(f"{q}.weight").data_ptr() == peft.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.data_ptr()
    adapter = export(peft)
    from_live = {k: v for b in fold_buckets(adapter, live, bucket_bytes=1 << 30) for k, v in b.items()}
    from_dir = {k: v for b in fold_buckets(adapter, saved, bucket_bytes=1 << 30) for k, v in b.items()}
    assert from_live.keys() == from_dir.keys() and all(torch.equal(from_live[k], from_dir[k]) for k in from_dir)
    assert torch.equal(live.get(f"{q}.weight"), saved.get(f"{q}.weight"))  # the fold never wrote the live base
    compiled = BaseWeights.from_model(torch.nn.ModuleDict({"_orig_mod": peft}))  # torch.compile's wrapper name
    assert set(compiled._tensors) == set(saved._files)
    assert set(BaseWeights.from_model(peft.base_model)._tensors) == set(saved._files)  # PEFT's LoraModel, not the PeftModel
    peft.merge_adapter()
    with pytest.raises(ConfigError, match="unmerge"):
        BaseWeights.from_model(peft)
    # Merged after the base was taken (TRL's vLLM sync merges around generation): the live base
    # is W0 + s·B·A now, and a fold from it would serve the delta twice. Refused at the fold.
    with pytest.raises(ConfigError, match="unmerge"):
        next(fold_buckets(adapter, live, bucket_bytes=1 << 30))
    peft.unmerge_adapter()
    assert next(fold_buckets(adapter, live, bucket_bytes=1 << 30))


def test_a_merged_publish_from_a_model_merged_meanwhile_fails_and_the_engine_keeps_its_weights(tmp_path):
    """The user's path: Publisher(transport="merged", base=BaseWeights.from_model(model)), the
    LoRA merged in between two publishes (outside attack, 2026-12-06: served W0 + 2·s·B·A, ok)."""
    from transformers import AutoModelForCausalLM

    from lorasync import Publisher
    from lorasync.exporters.fsdp import export
    from lorasync.testing import MemoryEngine, make_peft_model, make_tiny_model

    make_tiny_model(tmp_path / "base")
    peft = make_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), seed=5)
    engine = MemoryEngine()
    with Publisher([engine], name="p", transport="merged", root=tmp_path / "store", base=BaseWeights.from_model(peft)) as pub:
        assert pub.publish(export(peft), version=1).ok
        served = {k: v.clone() for k, v in engine.weights.items()}
        with torch.no_grad():
            for name, param in peft.named_parameters():
                if "lora_B" in name:
                    param.add_(0.01)
        peft.merge_adapter()
        report = pub.publish(export(peft), version=2)
        assert not report.ok and "unmerge" in str(report.results[0].error)
        assert engine.weights.keys() == served.keys() and all(torch.equal(engine.weights[k], served[k]) for k in served)


def test_a_fold_on_a_gpu_pushes_1_gib_buckets_wherever_that_is_decided(monkeypatch) -> None:
    # Each bucket is one weight-update call into the engine (40-60 ms on an H100 whatever its
    # size): a fold on a GPU pushes 1 GiB buckets, whether the GPU is named, is the adapter's or is
    # where W0 lives (the trainer's base: restore and rollback fold no adapter at all); a host fold
    # keeps 256 MiB; an explicit size wins. No GPU here: the base reports CUDA through fake tensors.
    import asyncio

    from torch._subclasses.fake_tensor import FakeTensorMode

    import lorasync.transports.merged as merged
    from lorasync.engines._engine import Capabilities
    from tests.support.adapters import MODULES, tiny_adapter

    with FakeTensorMode(allow_non_fake_inputs=True):
        gpu_base = BaseWeights.from_tensors({f"{m}.weight": torch.empty(16, 16, device="cuda") for m in MODULES})
    host_base = BaseWeights.from_tensors({f"{m}.weight": torch.zeros(16, 16) for m in MODULES})
    seen: list[int] = []
    monkeypatch.setattr(merged, "fold_buckets", lambda *a, bucket_bytes, **k: seen.append(bucket_bytes) or iter(()))

    class Engine:
        instance_id = "e"

        async def aupdate_weights(self, bucket):  # pragma: no cover - no bucket is folded
            pass

    caps = Capabilities(engine="fake", weight_update=True)
    for base, size, want in ((gpu_base, None, merged.GPU_BUCKET_BYTES), (host_base, None, merged.DEFAULT_BUCKET_BYTES), (gpu_base, 1 << 20, 1 << 20)):
        transport = merged.MergedTransport(base, bucket_bytes=size)
        seen.clear()
        asyncio.run(transport._push(Engine(), None, set(MODULES), caps))  # restore / rollback to W0
        asyncio.run(transport._push(Engine(), tiny_adapter(1), set(), caps))  # a host adapter onto that base
        assert seen == [want, want], (base.device, size, seen)
    assert merged.MergedTransport(host_base, device="cuda")._bucket_bytes("cuda") == merged.GPU_BUCKET_BYTES
