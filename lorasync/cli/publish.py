"""``lorasync publish DIR``: publish a saved PEFT adapter directory to engines."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from lorasync.cli._common import TRANSPORT_HELP, emit, plain, publish_exit_code, validate_engine_specs

__all__ = ["register"]

log = logging.getLogger("lorasync.cli")


def register(sub: Any) -> None:
    p = sub.add_parser("publish", help="publish a saved PEFT adapter directory to engines", description=plain(__doc__))
    p.add_argument("adapter_dir", help="directory with adapter_model.safetensors + adapter_config.json")
    p.add_argument("--engine", action="append", required=True, metavar="SPEC", help="engine spec like vllm:http://127.0.0.1:8000 (repeatable)")
    p.add_argument("--name", required=True, help="adapter name; engines serve NAME@vVERSION")
    p.add_argument("--version", required=True, type=int, help="monotonic version (e.g. the trainer step)")
    p.add_argument("--transport", default="auto", choices=("auto", "disk", "ipc", "merged"), help=TRANSPORT_HELP)
    p.add_argument("--keep", type=int, default=2, help="versions kept loaded per engine (default 2)")
    p.add_argument("--root", metavar="DIR", help="disk transport root (default /dev/shm/lorasync-<uid>, per user)")
    p.add_argument("--base", metavar="DIR", help="pristine base checkpoint (enables the merged fallback)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from lorasync.errors import ConfigError

    specs = validate_engine_specs(args.engine)
    if not Path(args.adapter_dir).is_dir():
        raise ConfigError(f"adapter directory {args.adapter_dir} does not exist; pass a directory written by Adapter.save or PEFT's save_pretrained")
    if not any((Path(args.adapter_dir) / n).exists() for n in ("adapter_config.json", "adapter_model.safetensors")):
        from lorasync.errors import StorageError  # before torch loads: a model folder is a mistake

        raise StorageError(
            f"{args.adapter_dir} holds no PEFT adapter: expected adapter_config.json and adapter_model.safetensors; "
            "pass the folder Adapter.save or PEFT's save_pretrained wrote"
        )
    from lorasync import Adapter, publish_adapter

    adapter = Adapter.load(args.adapter_dir)
    log.info("publishing %s as %s v%d to %s", args.adapter_dir, args.name, args.version, ", ".join(specs))
    report = publish_adapter(
        adapter, specs, name=args.name, version=args.version, transport=args.transport, keep=args.keep, root=args.root, base=args.base
    )
    code = publish_exit_code([report])
    emit({**report.to_dict(), "exit_code": code}, as_json=args.json, text=str(report), quiet=args.quiet)
    return code
