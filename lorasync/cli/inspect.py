"""``lorasync inspect DIR``: what PEFT, vLLM and SGLang would do with an adapter directory.

Exit code 0 when every engine loads it; 1 when an engine, or lorasync itself (what ``publish``
refuses), would refuse it; 2 when DIR cannot be read as an adapter: missing or not a directory, a
folder with neither adapter file (a model folder: ``publish`` refuses it the same way), an
adapter_config.json that is not a JSON object with PEFT's field types, an adapter_model.safetensors
that is not valid safetensors or holds a factor that is not 2-D, a directory, FIFO or device where
either file belongs. With --json every outcome is one strict JSON document (NaN written "NaN").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from lorasync.cli._common import OK, REFUSED, emit, plain

__all__ = ["register"]

ENGINES = ("peft", "vllm", "sglang")


def register(sub: Any) -> None:
    p = sub.add_parser("inspect", help="check an adapter directory against PEFT, vLLM and SGLang loader rules", description=plain(__doc__))
    p.add_argument("adapter_dir")
    p.add_argument("--vllm-max-rank", type=int, help="the vLLM server's --max-lora-rank, if known")
    p.add_argument("--sglang-max-rank", type=int, help="the SGLang server's --max-lora-rank, if known")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from lorasync.errors import ConfigError, StorageError

    path = Path(args.adapter_dir)
    if not path.exists():
        raise ConfigError(f"{path} does not exist; pass an adapter directory (adapter_config.json + adapter_model.safetensors)")
    if not path.is_dir():
        kind = "a file" if path.is_file() else "not a directory"
        raise ConfigError(f"{path} is {kind}; pass the adapter directory (the one holding adapter_config.json)")
    for option, value in (("--vllm-max-rank", args.vllm_max_rank), ("--sglang-max-rank", args.sglang_max_rank)):
        if value is not None and value < 1:
            raise ConfigError(f"{option} must be a positive integer (the server's --max-lora-rank), got {value}")
    names = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
    if not any(os.path.lexists(path / n) for n in names):
        # No adapter at all (a model folder, an empty one): the input is wrong, as `publish` says
        # with the same error, not an adapter some engine refuses. Checked before the slow import.
        model = " (it looks like a model folder: config.json)" if (path / "config.json").exists() else ""
        raise StorageError(
            f"{path} holds no PEFT adapter{model}: expected adapter_config.json and adapter_model.safetensors; "
            "pass the folder Adapter.save or PEFT's save_pretrained wrote"
        )
    from lorasync.inspection import inspect_adapter  # torch: only once there is an adapter to read

    report = inspect_adapter(path, vllm_max_rank=args.vllm_max_rank, sglang_max_rank=args.sglang_max_rank)
    code = OK if all(report.verdict(e) != "refused" for e in ENGINES) else REFUSED
    payload = {**dataclasses.asdict(report), "verdicts": {e: report.verdict(e) for e in ENGINES}, "ok": code == OK, "exit_code": code}
    emit(payload, as_json=args.json, text=str(report), quiet=args.quiet)
    return code
