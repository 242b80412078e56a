"""DeepSpeed ZeRO-3: a PEFT model whose LoRA parameters are partitioned across two CPU ranks
(real ``deepspeed.initialize`` over gloo) exports exactly the adapter of the unpartitioned
model on every rank; a ZeRO-3 state dict, or a ZeRO-3 model where deepspeed cannot be
imported, is refused with a typed error that says how (it used to be a misleading
ShapeMismatchError about empty tensors)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from support import run_distributed

pytest.importorskip("deepspeed")


def _worker(rank: int, world_size: int, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ["LOCAL_RANK"] = str(rank)  # deepspeed asks for it; one CPU "device" per rank
    import deepspeed

    from lorasync.errors import ExportError
    from lorasync.exporters.fsdp import export
    from lorasync.testing import make_peft_model, make_tiny_model

    model = make_peft_model(make_tiny_model(), seed=3)
    reference = export(model)  # before partitioning: the full tensors
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "zero_allow_untested_optimizer": True,
    }
    deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config)
    lora = [p for n, p in model.named_parameters() if "lora_A" in n]
    result: dict[str, Any] = {"partitioned": bool(lora) and all(hasattr(p, "ds_id") and p.numel() == 0 for p in lora)}
    adapter = export(model)  # collective: every rank gathers
    result["keys_equal"] = sorted(adapter.tensors) == sorted(reference.tensors)
    result["exact"] = all(torch.equal(adapter.tensors[k], reference.tensors[k]) for k in reference.tensors)
    result["config"] = (adapter.config.r, adapter.config.lora_alpha) == (reference.config.r, reference.config.lora_alpha)
    result["still_partitioned"] = all(p.numel() == 0 for p in lora)  # read-only gather, released again
    try:
        export(dict(model.named_parameters()), alpha=16)
    except ExportError as exc:
        result["state_dict_error"] = str(exc)
    saved = sys.modules.get("deepspeed")
    sys.modules["deepspeed"] = None  # type: ignore[assignment]  # "not importable here"
    try:
        export(model)
    except ExportError as exc:
        result["no_deepspeed_error"] = str(exc)
    finally:
        sys.modules["deepspeed"] = saved  # type: ignore[assignment]
    torch.save(result, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ds_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("zero3")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the spawned ranks inherit it
    run_distributed(_worker, str(out), world_size=2, timeout_s=300)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_zero3_partitioned_lora_exports_exactly_on_every_rank(ds_run: list[dict[str, Any]]) -> None:
    for result in ds_run:
        assert result["partitioned"], "the test must really partition the LoRA parameters"
        assert result["keys_equal"] and result["exact"] and result["config"]
        assert result["still_partitioned"]


def test_zero3_refusals_say_how(ds_run: list[dict[str, Any]]) -> None:
    for result in ds_run:
        assert "ZeRO-3 partition" in result["state_dict_error"] and "Pass the model itself" in result["state_dict_error"]
        assert "deepspeed is not importable" in result["no_deepspeed_error"]
        assert "GatheredParameters" in result["no_deepspeed_error"]
