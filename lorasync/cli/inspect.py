"""``lorasync inspect DIR``: what PEFT, vLLM and SGLang would do with an adapter directory.

Exit code 1 when an engine would refuse the adapter, 2 when DIR does not exist.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from lorasync.cli._common import OK, REFUSED, emit

__all__ = ["register"]

ENGINES = ("peft", "vllm", "sglang")


def register(sub: Any) -> None:
    p = sub.add_parser("inspect", help="check an adapter directory against PEFT, vLLM and SGLang loader rules", description=__doc__)
    p.add_argument("adapter_dir")
    p.add_argument("--vllm-max-rank", type=int, help="the vLLM server's --max-lora-rank, if known")
    p.add_argument("--sglang-max-rank", type=int, help="the SGLang server's --max-lora-rank, if known")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from lorasync.errors import ConfigError
    from lorasync.inspection import inspect_adapter

    path = Path(args.adapter_dir)
    if not path.exists():
        raise ConfigError(f"{path} does not exist; pass an adapter directory (adapter_config.json + adapter_model.safetensors)")
    if not path.is_dir():
        raise ConfigError(f"{path} is a file; pass the adapter directory that holds it")
    report = inspect_adapter(path, vllm_max_rank=args.vllm_max_rank, sglang_max_rank=args.sglang_max_rank)
    code = OK if all(report.verdict(e) != "refused" for e in ENGINES) else REFUSED
    payload = {**dataclasses.asdict(report), "verdicts": {e: report.verdict(e) for e in ENGINES}, "ok": code == OK, "exit_code": code}
    emit(payload, as_json=args.json, text=str(report), quiet=args.quiet)
    return code
