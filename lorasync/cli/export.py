"""``lorasync export megatron``: per-rank Megatron-Bridge adapter files → a PEFT adapter directory.

The main CLI calls :func:`register` with its sub-parser collection; the parsed namespace carries
``func`` (:func:`run_megatron`), which returns the process exit code.

Shard files are found with a pattern whose placeholders ``{tp}``, ``{pp}``, ``{ep}`` and ``{vp}``
take Python format specs, e.g. ``ckpt/mp_rank_{tp:02d}_{pp:03d}.safetensors``. A file counts only
if formatting the pattern with the ranks parsed from its name gives the name back, so
``mp_rank_1_000`` does not match ``{tp:02d}``. Everything else in the pattern is literal (glob
characters included); a literal brace is written ``{{`` or ``}}``. A malformed pattern (unbalanced
brace, another placeholder, a spec such as ``{tp:s}`` that cannot write an int as digits) is a
:class:`~lorasync.errors.ConfigError`, never a traceback.
"""

from __future__ import annotations

import argparse
import glob
import re
import string
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorasync.errors import ConfigError, MissingShardError, StorageError

if TYPE_CHECKING:
    import torch

__all__ = ["load_shard", "register", "run_megatron", "shard_files"]

_PLACEHOLDERS = ("tp", "pp", "ep", "vp")
_DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names; torch loads only when a command runs


def register(subparsers: Any) -> None:
    """Add ``export megatron`` to the main CLI's sub-parsers."""
    export = subparsers.add_parser("export", help="export trainer LoRA weights to a PEFT adapter directory")
    kinds = export.add_subparsers(dest="exporter", metavar="TRAINER", required=True)
    p = kinds.add_parser(
        "megatron",
        help="Megatron-Bridge LoRA shards (one file per rank) to PEFT",
        description="Gather per-rank Megatron-Bridge adapter files and write adapter_model.safetensors "
        "+ adapter_config.json.",
    )
    p.add_argument("--shards", required=True, metavar="PATTERN",
                   help="per-rank files, placeholders {tp} {pp} {ep} {vp} with format specs, "
                   "e.g. 'ckpt/mp_rank_{tp:02d}_{pp:03d}.safetensors' (.safetensors, or .pt/.pth "
                   "read with torch.load(weights_only=True))")
    p.add_argument("--base-config", required=True, metavar="PATH", help="base model config.json or its directory")
    p.add_argument("--alpha", required=True, type=float, help="LoRA alpha of the trained adapter")
    p.add_argument("--rank", type=int, default=None, help="trained rank; zero max-rank padding beyond it is trimmed")
    p.add_argument("--out", required=True, metavar="DIR", help="output adapter directory")
    p.add_argument("--lora-type", choices=("lora", "canonical_lora"), default="lora")
    p.add_argument("--slot", type=int, default=None, help="MultiLoRA slot to export (adapters.{slot})")
    p.add_argument("--layer-offsets", default=None, metavar="N,N,...",
                   help="first global layer of each PP stage in PP-rank order, starting at 0, e.g. 0,3 for "
                   "3+2 layers (uneven pipelines); default: even split")
    p.add_argument("--tp-size", type=int, default=None, help="expected TP size (detects missing trailing ranks)")
    p.add_argument("--pp-size", type=int, default=None, help="expected PP size")
    p.add_argument("--ep-size", type=int, default=None, help="expected EP size")
    p.add_argument("--dtype", choices=_DTYPES, default=None, help="cast the exported tensors")
    p.add_argument("--base-model-name-or-path", default=None, help="recorded in adapter_config.json")
    p.set_defaults(func=run_megatron)


def run_megatron(args: argparse.Namespace) -> int:
    """Handle ``lorasync export megatron``: load the shards, export, save.

    Returns:
        `int`: 0 on success (errors are raised as lorasync errors for the main CLI to report).

    Raises:
        MissingShardError: no file matches the pattern.
        StorageError: a file cannot be read (not safetensors, truncated, a directory) or the
            output cannot be written.
        ConfigError: a bad option value or a malformed ``--shards`` pattern.
        ExportError: anything :func:`lorasync.exporters.megatron.export` refuses.

    Every failure is one of these lorasync errors, so the main CLI reports it with exit code 2
    (bad input) and, with ``--json``, as a JSON document.
    """
    import torch

    from lorasync.exporters.megatron import ShardKey, export

    if not str(args.out).strip():  # an unset shell variable: would write into the working directory
        raise ConfigError("--out is empty; pass the directory to write the adapter into")
    offsets = None
    if args.layer_offsets:
        try:
            offsets = [int(x) for x in args.layer_offsets.split(",")]
        except ValueError as exc:
            raise ConfigError(f"--layer-offsets must be comma-separated integers, got {args.layer_offsets!r}") from exc
    files = shard_files(args.shards)
    shards: dict[ShardKey, Mapping[str, torch.Tensor]] = {}
    vp_in_pattern = any(field == "vp" for _, field in _pattern_fields(args.shards))
    for key, path in files.items():
        for vp, state in enumerate(load_shard(path, split_chunks=not vp_in_pattern)):
            shards[ShardKey(pp=key.pp, tp=key.tp, ep=key.ep, vp=key.vp if vp_in_pattern else vp)] = state
    adapter = export(
        shards,
        base_config=args.base_config,
        rank=args.rank,
        alpha=args.alpha,
        lora_type=args.lora_type,
        slot=args.slot,
        layer_offsets=offsets,
        tp_size=args.tp_size,
        pp_size=args.pp_size,
        ep_size=args.ep_size,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        base_model_name_or_path=args.base_model_name_or_path,
    )
    out = adapter.save(args.out)
    from lorasync.cli._common import emit

    summary = {
        "ok": True, "exit_code": 0, "out": str(out), "modules": len(adapter.modules), "shard_files": len(files),
        "r": adapter.config.r, "lora_alpha": adapter.config.lora_alpha, "content_hash": adapter.content_hash,
    }  # fmt: skip
    text = (
        f"exported {len(adapter.modules)} modules from {len(files)} shard files "
        f"(r={adapter.config.r}, alpha={adapter.config.lora_alpha}) to {out}"
    )
    emit(summary, as_json=getattr(args, "json", False), text=text, quiet=getattr(args, "quiet", False))
    return 0


def shard_files(pattern: str) -> dict[Any, Path]:
    """Files matching ``pattern``, keyed by ``ShardKey``.

    Raises:
        ConfigError: a malformed pattern: an unbalanced brace, a placeholder other than
            ``{tp}``/``{pp}``/``{ep}``/``{vp}``, or a format spec that does not write an int as digits.
        MissingShardError: no file matches.
    """
    from lorasync.exporters.megatron import ShardKey

    fields = _pattern_fields(pattern)
    globbed, regex_parts, named = [], [], set()
    for literal, field in fields:
        globbed.append(glob.escape(literal))
        regex_parts.append(re.escape(literal))
        if field is not None:
            globbed.append("*")
            # a repeated placeholder matches digits again; formatting the name back checks it agrees
            regex_parts.append(r"\d+" if field in named else rf"(?P<{field}>\d+)")
            named.add(field)
    regex = re.compile("".join(regex_parts))
    found: dict[Any, Path] = {}
    for name in sorted(glob.glob("".join(globbed))):
        match = regex.fullmatch(name)
        if match is None:
            continue
        ranks = {k: int(v) for k, v in match.groupdict().items()}
        if pattern.format(**{f: ranks.get(f, 0) for f in _PLACEHOLDERS}) != name:
            continue  # e.g. unpadded numbers where the pattern asks for {tp:02d}
        found[ShardKey(**ranks)] = Path(name)
    if not found:
        raise MissingShardError(
            f"no file matches --shards {pattern!r} (looked for {''.join(globbed)!r}); placeholders are "
            "{tp}, {pp}, {ep}, {vp}, e.g. 'ckpt/mp_rank_{tp:02d}_{pp:03d}.safetensors'"
        )
    return found


def _pattern_fields(pattern: str) -> list[tuple[str, str | None]]:
    """``pattern`` as (literal text, placeholder or None) pairs, every placeholder checked.

    Raises:
        ConfigError: naming the bad part and the form to write instead.
    """
    form = "placeholders are {tp}, {pp}, {ep}, {vp} with an optional int format spec such as {tp:02d}; write a literal brace as {{ or }}"
    try:
        parts = list(string.Formatter().parse(pattern))
    except ValueError as exc:  # unbalanced braces
        raise ConfigError(f"--shards {pattern!r} is not a valid pattern ({exc}); {form}") from exc
    out: list[tuple[str, str | None]] = []
    for literal, field, spec, conversion in parts:
        if field is not None:
            shown = "{" + field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            if field not in _PLACEHOLDERS or conversion:
                raise ConfigError(f"--shards {pattern!r} has the placeholder {shown}; {form}")
            _check_spec(pattern, shown, spec or "", form)
        out.append((literal, field))
    return out


def _check_spec(pattern: str, shown: str, spec: str, form: str) -> None:
    for n in (0, 7, 10, 123):
        try:
            text = format(n, spec)
        except ValueError as exc:  # e.g. {tp:s}: "Unknown format code 's' for object of type 'int'"
            raise ConfigError(f"--shards {pattern!r}: {shown} cannot format a rank ({exc}); {form}") from exc
        if not (text.isascii() and text.isdigit() and int(text) == n):
            raise ConfigError(
                f"--shards {pattern!r}: {shown} writes rank {n} as {text!r}, not as its decimal digits; {form}"
            )


def load_shard(path: Path, *, split_chunks: bool = True) -> list[dict[str, torch.Tensor]]:
    """Tensors of one rank's file: safetensors, or a ``.pt`` read with ``weights_only=True``.

    A ``.pt`` holding ``{"model": state_dict}`` (Megatron's legacy layout) is unwrapped; one with
    ``model0``, ``model1``, ... yields one state dict per virtual-pipeline chunk.

    Raises:
        StorageError: unreadable file, or a ``.pt`` that needs pickle beyond plain tensors.
    """
    import pickle

    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        if path.suffix == ".safetensors":
            return [load_file(str(path))]
        loaded = torch.load(str(path), map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError, SafetensorError) as exc:
        raise StorageError(
            f"cannot read shard {path}: {exc}; use .safetensors, or a .pt holding only tensors"
        ) from exc
    if not isinstance(loaded, Mapping):
        raise StorageError(f"shard {path} holds a {type(loaded).__name__}, not a state dict")
    chunks = sorted((k for k in loaded if re.fullmatch(r"model\d+", str(k))), key=lambda k: int(k[5:]))
    if split_chunks and chunks:
        return [_tensors(loaded[k]) for k in chunks]
    if isinstance(loaded.get("model"), Mapping):
        return [_tensors(loaded["model"])]
    return [_tensors(loaded)]


def _tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    import torch

    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
