"""The real-peer run: real Megatron-Bridge models, real LoRA / CanonicalLoRA / DoRA, lorasync's export.

Runs inside the Megatron venv (scripts/megatron-venv.sh), started by
tests/megatron/test_megatron_bridge_peer.py as ``python bridge_peer.py SPEC.json OUT.json`` with the
lorasync checkout on PYTHONPATH. It spawns ``world`` gloo ranks on the CPU; every rank runs every
case of the spec in turn (one process start-up for the whole suite):

1. a tiny HF checkpoint (Qwen2 dense or Qwen3-MoE, random weights) made once per model;
2. ``AutoBridge`` converts it at the case's TP/PP/EP layout (local layer spec, fp32, CPU);
3. the case's PEFT method is applied and every adapter parameter gets random values (seeded by
   its name and the ranks that hold distinct shards, so replicas agree);
4. each rank's adapter state dict goes through ``export_distributed`` (gloo) and, gathered to
   rank 0, through the offline ``export``;
5. rank 0 compares: logits of Megatron's own forward (PP=1 layouts) with HF transformers + PEFT
   loading lorasync's adapter, and lorasync's tensors with Megatron-Bridge's own
   ``export_adapter_weights`` where that one is right.

Results (numbers and refusals, per case) are written as JSON for the pytest side to assert on.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import traceback
import zlib
from pathlib import Path
from typing import Any

SEQ = [3, 17, 42, 7, 99, 64, 5, 23]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_checkpoint(kind: str, directory: Path) -> Path:
    """A tiny random HF checkpoint of ``kind`` ("dense" or "moe") under ``directory``."""
    import torch
    import transformers

    path = directory / kind
    if (path / "config.json").exists():
        return path
    common = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(1234)
    if kind == "dense":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(intermediate_size=48, **common))
    else:
        config = transformers.Qwen3MoeConfig(
            intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
            head_dim=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common,
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    model.save_pretrained(path)
    return path


def _seed(name: str, *coords: int) -> int:
    return zlib.crc32(f"{name}|{coords}".encode())


def _randomize(model: Any, *, tp: int, pp: int, ep: int, vp: int) -> None:
    """Random adapter values, equal on replicas: seeded by name + (pp, vp, tp) (+ ep for experts)."""
    import torch

    for name, param in model.named_parameters():
        if ".adapter" not in name:
            continue
        expert = ".experts." in name
        gen = torch.Generator().manual_seed(_seed(name, pp, vp, tp, ep if expert else 0))
        with torch.no_grad():
            if name.endswith("weight_magnitude"):
                param.mul_(1 + 0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=gen))


def _peft(method: str, targets: list[str]) -> Any:
    from megatron.bridge.peft.canonical_lora import CanonicalLoRA
    from megatron.bridge.peft.dora import DoRA
    from megatron.bridge.peft.lora import LoRA

    cls = {"lora": LoRA, "canonical_lora": CanonicalLoRA, "dora": DoRA}[method]
    return cls(target_modules=targets, dim=8, alpha=16)


def _build(case: dict[str, Any], ckpt: Path) -> tuple[Any, Any]:
    import torch
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.gpt_provider import local_layer_spec

    bridge = AutoBridge.from_hf_pretrained(str(ckpt), torch_dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.transformer_layer_spec = local_layer_spec
    provider.tensor_model_parallel_size = case["tp"]
    provider.pipeline_model_parallel_size = case["pp"]
    provider.virtual_pipeline_model_parallel_size = case.get("vp")
    provider.expert_model_parallel_size = case["ep"]
    provider.expert_tensor_parallel_size = case["tp"]
    provider.sequence_parallel = False
    provider.params_dtype = torch.float32
    provider.bf16 = False
    provider.fp16 = False
    provider.parallel_output = False  # full logits on every TP rank
    provider.gradient_accumulation_fusion = False
    provider.masked_softmax_fusion = False
    provider.bias_activation_fusion = False
    provider.bias_dropout_fusion = False
    provider.persist_layer_norm = False
    provider.apply_rope_fusion = False
    provider.attention_dropout = 0.0
    provider.hidden_dropout = 0.0
    provider.moe_grouped_gemm = False
    provider.moe_token_dispatcher_type = "allgather"
    provider.moe_router_dtype = "fp32"
    provider.moe_permute_fusion = False  # TransformerEngine kernels
    provider.moe_router_fusion = False
    provider.use_cpu_initialization = True
    provider.finalize()
    model = provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None
    )
    model = _peft(case["method"], case["targets"])(model, training=False)
    for chunk in model:
        chunk.eval()
    return bridge, model


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_case(case: dict[str, Any], ckpt: Path, scratch: Path) -> dict[str, Any] | None:
    """One case on every rank; returns the result on global rank 0, None elsewhere."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from lorasync.exporters import megatron

    ps.initialize_model_parallel(
        tensor_model_parallel_size=case["tp"], pipeline_model_parallel_size=case["pp"],
        expert_model_parallel_size=case["ep"], expert_tensor_parallel_size=case["tp"],
        virtual_pipeline_model_parallel_size=case.get("vp"),
    )
    try:
        bridge, model = _build(case, ckpt)
        tp, pp, ep = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
        for vp, chunk in enumerate(model):
            _randomize(chunk, tp=tp, pp=pp, ep=ep, vp=vp)
        # one state dict per virtual-pipeline chunk, stage-local layer numbers
        local = [{n: p.detach().clone() for n, p in chunk.named_parameters() if ".adapter" in n} for chunk in model]
        result: dict[str, Any] = {"id": case["id"]}
        groups = dict(
            tp_group=ps.get_tensor_model_parallel_group() if case["tp"] > 1 else None,
            pp_group=ps.get_pipeline_model_parallel_group() if case["pp"] > 1 else None,
            ep_group=ps.get_expert_model_parallel_group() if case["ep"] > 1 else None,
        )
        cfg = json.loads((ckpt / "config.json").read_text())
        lora_type = "canonical_lora" if case["method"] == "canonical_lora" else "lora"
        try:
            online = megatron.export_distributed(local if len(local) > 1 else local[0], base_config=cfg, alpha=16, rank=8, lora_type=lora_type, **groups)
        except Exception as exc:  # recorded, asserted by the pytest side
            online, result["online_error"] = None, _error(exc)
        # the offline export: every rank's state dict on rank 0
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {"key": (pp, tp, ep), "state": local})
        logits = None
        if case["pp"] == 1:
            ids = torch.tensor([SEQ])
            with torch.no_grad():
                logits = model[0](input_ids=ids, position_ids=torch.arange(len(SEQ))[None], attention_mask=None)
        bridge_export = None
        if case.get("bridge_export"):
            bridge_export = {n: t.clone() for n, t in bridge.export_adapter_weights(model, cpu=True, show_progress=False)}
        if dist.get_rank() != 0:
            return None
        shards = {}
        for item in gathered:
            for vp, state in enumerate(item["state"]):
                shards.setdefault((*item["key"], vp), state)
        try:
            offline = megatron.export(shards, base_config=cfg, alpha=16, rank=8, lora_type=lora_type)
        except Exception as exc:
            offline, result["offline_error"] = None, _error(exc)
        if offline is not None and online is not None:
            result["online_equals_offline"] = sorted(online.tensors) == sorted(offline.tensors) and all(
                torch.equal(online.tensors[k], offline.tensors[k]) for k in offline.tensors
            )
        if case["method"] == "dora":  # what exporting DoRA as plain LoRA would serve
            plain = {k: {n: t for n, t in s.items() if not n.endswith("weight_magnitude")} for k, s in shards.items()}
            offline = megatron.export(plain, base_config=cfg, alpha=16, rank=8)
            result["dropped_magnitudes"] = True
        if offline is not None and logits is not None:
            result.update(_compare_forward(offline, ckpt, logits, scratch / case["id"]))
        if offline is not None and bridge_export is not None:
            result.update(_compare_bridge(offline, bridge_export))
        return result
    finally:
        ps.destroy_model_parallel()


def _compare_forward(adapter: Any, ckpt: Path, logits: Any, out: Path) -> dict[str, float]:
    """HF transformers + PEFT with lorasync's adapter vs Megatron's own logits."""
    import torch
    import transformers
    from peft import PeftModel

    _with_zero_expert_down(adapter).save(out)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), torch_dtype=torch.float32)
    ids = torch.tensor([SEQ])
    with torch.no_grad():
        base_logits = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, str(out)).eval()(ids).logits
    mine = logits.reshape(peft_logits.shape).float()
    # Megatron's own logits, kept beside the adapter for checks made outside this venv
    # (tests/megatron/test_moe_bridge_peer_cross_check.py).
    from safetensors.torch import save_file

    save_file({"logits": mine.contiguous(), "ids": ids}, str(out.parent / f"{out.name}.megatron-logits.safetensors"))
    return {
        "forward_max_diff": float((mine - peft_logits).abs().max()),
        "adapter_effect": float((mine - base_logits).abs().max()),
    }


def _with_zero_expert_down(adapter: Any) -> Any:
    """PEFT 0.21 on transformers 5 folds per-expert names into the fused ``gate_up_proj`` /
    ``down_proj`` parameters, and misses the keys when only gate/up are present; an all-zero
    down_proj adapter (no effect on the output) makes it load them. Reference-side only."""
    import dataclasses
    import re

    import torch

    from lorasync import Adapter

    tensors = dict(adapter.tensors)
    gate = re.compile(r"^(.*\.mlp\.experts\.\d+\.)gate_proj\.lora_A\.weight$")
    added = False
    for key in list(tensors):
        match = gate.match(key)
        if match is None or f"{match[1]}down_proj.lora_A.weight" in tensors:
            continue
        a = tensors[key]
        up_b = tensors[f"{match[1]}up_proj.lora_B.weight"]
        tensors[f"{match[1]}down_proj.lora_A.weight"] = torch.zeros(a.shape[0], up_b.shape[0], dtype=a.dtype)
        tensors[f"{match[1]}down_proj.lora_B.weight"] = torch.zeros(a.shape[1], a.shape[0], dtype=a.dtype)
        added = True
    if not added:
        return adapter
    config = dataclasses.replace(adapter.config, target_modules=(*adapter.config.target_modules, "down_proj"))
    return Adapter(tensors, config)


def _compare_bridge(adapter: Any, bridge_export: dict[str, Any]) -> dict[str, Any]:
    """lorasync's tensors vs Megatron-Bridge's own adapter export (HF names)."""
    import torch

    def norm(name: str) -> str:
        name = name.removeprefix("base_model.model.").replace(".default.", ".")
        return name

    theirs = {norm(n): t for n, t in bridge_export.items()}
    mine = {norm(n): t for n, t in adapter.tensors.items()}
    common = sorted(set(theirs) & set(mine))
    diff = [n for n in common if not torch.equal(theirs[n].to(mine[n].dtype), mine[n])]
    return {
        "bridge_keys_only_theirs": sorted(set(theirs) - set(mine))[:5],
        "bridge_keys_only_mine": sorted(set(mine) - set(theirs))[:5],
        "bridge_common": len(common),
        "bridge_different": diff[:5],
    }


def worker(rank: int, world: int, port: int, spec: dict[str, Any], out: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import cpu_standins

    cpu_standins.install()
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    scratch = Path(spec["scratch"])
    results = []
    for case in spec["cases"]:
        ckpt = scratch / case["model"]
        try:
            result = run_case(case, ckpt, scratch)
        except Exception as exc:
            result = {"id": case["id"], "crash": _error(exc), "trace": traceback.format_exc()[-3000:]}
            if rank != 0:
                result = None
        if result is not None:
            results.append(result)
            Path(out).write_text(json.dumps(results, indent=1))
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    spec = json.loads(Path(sys.argv[1]).read_text())
    out = sys.argv[2]
    scratch = Path(spec.get("scratch") or tempfile.mkdtemp())
    spec["scratch"] = str(scratch)
    for kind in {case["model"] for case in spec["cases"]}:
        make_checkpoint(kind, scratch)
    mp.start_processes(worker, args=(spec["world"], _free_port(), spec, out), nprocs=spec["world"], start_method="spawn")


if __name__ == "__main__":
    main()
