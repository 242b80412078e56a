"""``lorasync publish DIR``: publish a saved PEFT adapter directory to engines."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["register"]


def register(sub: Any) -> None:
    p = sub.add_parser("publish", help="publish a saved PEFT adapter directory to engines", description=__doc__)
    p.add_argument("adapter_dir", help="directory with adapter_model.safetensors + adapter_config.json")
    p.add_argument("--engine", action="append", required=True, metavar="SPEC", help="engine spec like vllm:http://127.0.0.1:8000 (repeatable)")
    p.add_argument("--name", required=True, help="adapter name; engines serve NAME@vVERSION")
    p.add_argument("--version", required=True, type=int, help="monotonic version (e.g. the trainer step)")
    p.add_argument("--transport", default="auto", choices=("auto", "disk", "ipc", "merged"))
    p.add_argument("--keep", type=int, default=2, help="versions kept loaded per engine (default 2)")
    p.add_argument("--root", metavar="DIR", help="disk transport root (default /dev/shm/lorasync)")
    p.add_argument("--base", metavar="DIR", help="pristine base checkpoint (enables the merged fallback)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from lorasync import Adapter, publish_adapter

    adapter = Adapter.load(args.adapter_dir)
    report = publish_adapter(
        adapter, args.engine, name=args.name, version=args.version, transport=args.transport, keep=args.keep, root=args.root, base=args.base
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 0 if report.ok else 1
