"""``lorasync inspect DIR``: what PEFT, vLLM and SGLang would do with an adapter directory."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register"]


def register(sub: Any) -> None:
    p = sub.add_parser("inspect", help="check an adapter directory against PEFT, vLLM and SGLang loader rules", description=__doc__)
    p.add_argument("adapter_dir")
    p.add_argument("--vllm-max-rank", type=int, help="the vLLM server's --max-lora-rank, if known")
    p.add_argument("--sglang-max-rank", type=int, help="the SGLang server's --max-lora-rank, if known")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from lorasync.inspection import inspect_adapter

    report = inspect_adapter(args.adapter_dir, vllm_max_rank=args.vllm_max_rank, sglang_max_rank=args.sglang_max_rank)
    print(report)
    return 0 if all(report.verdict(e) != "refused" for e in ("peft", "vllm", "sglang")) else 1
