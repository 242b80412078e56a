"""Where ``fsdp.export(model)`` spends its time on a Qwen3-8B-shaped PEFT model (the ``model_export``
section of ``benchmarks/gpu_bench.py``).

The engines section showed the default row (``publish(export(model))``) ~15-20 ms above the
``ipc`` row (``publish(live)``) on the H100, all of it before the publish starts. This section
times export and its parts on the same model layout (36 layers, all-linear r16, bf16, built on
the meta device and materialised where asked, so nothing is drawn or saved): the module walk,
the collection of the LoRA factors, the config and fused-expert lookups, and the Adapter's own
construction, plus a cProfile summary. On the CPU it runs at width 64 (the layout, not the
bytes, is what the walk costs).

Usage: ``python benchmarks/gpu_bench.py --sections model_export`` (GPU), or
``python benchmarks/gpu_model_export.py`` (CPU, width 64).
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["model_export"]


def _model(device: str, width: int | None) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if width is None:  # Qwen3-8B
        dims = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936)
    else:
        dims = dict(hidden_size=width, intermediate_size=2 * width, num_attention_heads=4, num_key_value_heads=2, head_dim=width // 4, vocab_size=256)
    config = Qwen3Config(num_hidden_layers=36, **dims)
    with torch.device("meta"):
        base = Qwen3ForCausalLM(config)
    base = base.to_empty(device=device).to(torch.bfloat16)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0))
    return model.to(device).eval()


def _ms(fn: Callable[[], object], repeat: int = 30, warmup: int = 3) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"median": statistics.median(times), "min": times[0], "max": times[-1]}


def model_export(results: dict, quick: bool, *, device: str = "cuda", width: int | None = None) -> None:
    """Export's time and its parts, ms (median of 30 unless ``quick``)."""
    from lorasync.adapter._adapter import Adapter
    from lorasync.adapter._moe_peft import targets_in_model
    from lorasync.exporters import fsdp

    model = _model(device, width)
    repeat = 10 if quick else 30
    out: dict[str, Any] = {"device": device, "width": width or 4096, "modules": sum(1 for _ in model.named_modules())}
    tree = fsdp._walk(model)
    raw = fsdp._collect(tree.lora, "default", copy=False)
    adapter = fsdp.export(model)
    out["tensors"] = len(raw)
    out["export"] = _ms(lambda: fsdp.export(model), repeat)
    out["named_modules"] = _ms(lambda: sum(1 for _ in model.named_modules()), repeat)
    out["walk"] = _ms(lambda: fsdp._walk(model), repeat)
    out["collect"] = _ms(lambda: fsdp._collect(tree.lora, "default", copy=False), repeat)
    out["find_peft_config"] = _ms(lambda: fsdp._find_peft_config(model, "default"), repeat)
    out["targets_in_model"] = _ms(lambda: targets_in_model(tree.wrappers, "default", lambda n: fsdp._module_of(n, "default")), repeat)
    out["model_type"] = _ms(lambda: fsdp._model_type(model), repeat)
    out["adapter_init"] = _ms(lambda: Adapter(raw, adapter.config), repeat)
    out["export_again"] = _ms(lambda: fsdp.export(model), repeat)  # the spread of the first row
    counts = gc.get_count()
    before = [s["collections"] for s in gc.get_stats()]
    for _ in range(repeat):
        fsdp.export(model)
    out["gc_collections_per_export"] = [(s["collections"] - b) / repeat for s, b in zip(gc.get_stats(), before)]
    out["gc_count_before"] = list(counts)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(10):
        fsdp.export(model)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    out["profile_tottime"] = text.getvalue()[-6000:]
    results["model_export"] = out
    del model, adapter, raw, tree
    if device == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    import json

    res: dict = {}
    model_export(res, False, device="cpu", width=64)
    profile = res["model_export"].pop("profile_tottime")
    print(json.dumps(res, indent=1))
    print(profile)
