"""Check an adapter directory against the loader rules of PEFT, vLLM and SGLang.

``inspect_adapter(dir)`` reads only ``adapter_config.json`` and the safetensors header (no
tensor data, no pickle) and returns, per engine, whether it would load the adapter and how it
would scale it — the problems that otherwise surface as a 500 from the engine, or worse as an
adapter that loads but is scaled differently than in training.

Keys are split by :func:`lorasync.adapter._keys.split_saved_key`, SGLang's verdicts come from
:mod:`lorasync.engines.sglang.rules` (what its client and the publisher enforce), and
:meth:`Adapter.load`'s checks run on meta tensors built from the header: whatever lorasync
refuses, every verdict is ``"refused"``. An unreadable folder raises a typed error (CLI exit 2).
Not ``safetensors.safe_open`` (it blocks for ever on a FIFO): the header is read from a descriptor.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from lorasync.adapter._adapter import _MAX_HEADER, _SAFETENSORS_DTYPES, ADAPTER_CONFIG, ADAPTER_WEIGHTS, Adapter, extra_weight_files
from lorasync.adapter._config import AdapterConfig
from lorasync.adapter._keys import split_saved_key
from lorasync.adapter._moe import group_experts
from lorasync.adapter._moe_peft import targets_in_keys
from lorasync.engines.sglang import rules as sglang_rules
from lorasync.engines.vllm import moe as vllm_moe
from lorasync.errors import AdapterError, ConfigError, LoraSyncError, ShapeMismatchError, StorageError

__all__ = ["Finding", "Inspection", "inspect_adapter"]

_VLLM_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_MAX_CONFIG = 16 * 1024 * 1024  # PEFT writes kilobytes; the bound keeps a hostile file out of memory
_MAX_DEPTH = 32  # PEFT's fields nest 2 deep; deeper JSON would only exhaust the recursion limit later
# The JSON type of each config field inspect reads (null counts as absent): a wrong type makes the
# config unreadable (exit 2), a wrong value of the right type is a finding.
_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "r": ((int,), "a JSON integer such as 8"), "lora_alpha": ((int, float), "a JSON number such as 16"),
    "rank_pattern": ((dict,), "a JSON object {module: rank}"), "alpha_pattern": ((dict,), "a JSON object {module: alpha}"),
    "use_rslora": ((bool,), "true or false"), "use_dora": ((bool,), "true or false"), "bias": ((str,), 'a string such as "none"'),
    "modules_to_save": ((list,), "a JSON list"), "target_modules": ((list, str), "a JSON list"), "target_parameters": ((list, str), "a JSON list"),
}  # fmt: skip
_RESAVE = "re-save the adapter with Adapter.save or PEFT save_pretrained"


@dataclass
class Finding:
    """One problem (or note) for one engine, or for ``"all"``."""

    engine: str  # "peft" | "vllm" | "sglang" | "all"
    level: str  # "error" (refused) | "warning" (loads, but differs) | "info"
    message: str


@dataclass
class Inspection:
    """What :func:`inspect_adapter` found; ``verdict(engine)`` sums it up per engine."""

    path: str
    rank: int | None = None
    ranks: dict[str, int] = field(default_factory=dict)
    modules: list[str] = field(default_factory=list)
    dtype: str | None = None
    nbytes: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)

    def verdict(self, engine: str) -> str:
        """``"refused"``, ``"loads with caveats"`` or ``"loads"`` for ``engine``."""
        levels = {f.level for f in self.findings if f.engine in (engine, "all")}
        return "refused" if "error" in levels else ("loads with caveats" if "warning" in levels else "loads")

    def __str__(self) -> str:
        lines = [
            f"adapter {self.path}",
            f"  modules: {len(self.modules)} ({', '.join(sorted({m.rsplit('.', 1)[-1] for m in self.modules}))})",
            f"  rank: {self.rank}  dtype: {self.dtype}  size: {self.nbytes / 1e6:.2f} MB",
            f"  r={self.config.get('r')} lora_alpha={self.config.get('lora_alpha')} use_rslora={self.config.get('use_rslora', False)}"
            f" rank_pattern={self.config.get('rank_pattern') or {}} alpha_pattern={self.config.get('alpha_pattern') or {}}",
        ]
        for engine in ("peft", "vllm", "sglang"):
            lines.append(f"  {engine:<7} {self.verdict(engine)}")
            for f in self.findings:
                if f.engine in (engine, "all") and f.level != "info":
                    lines.append(f"           {f.level}: {f.message}")
        for f in self.findings:
            if f.level == "info":
                lines.append(f"  note: {f.message}")
        return "\n".join(lines)


def inspect_adapter(directory: str | os.PathLike[str], *, vllm_max_rank: int | None = None, sglang_max_rank: int | None = None) -> Inspection:
    """Inspect a PEFT adapter directory without loading tensor data.

    Args:
        directory: the adapter directory.
        vllm_max_rank / sglang_max_rank: the servers' ``--max-lora-rank`` if known.

    Returns:
        `Inspection`: findings per engine; ``str()`` renders a report.

    Raises:
        ConfigError: ``adapter_config.json`` is not a UTF-8 JSON object, or a field has the wrong
            JSON type (``r`` a string, ``rank_pattern`` a list).
        AdapterError: ``adapter_model.safetensors`` is not a valid safetensors file (truncated,
            offsets that do not fit); ``ShapeMismatchError`` for a LoRA factor that is not 2-D.
        StorageError: a file that is not a regular file (a directory, FIFO, device) or unreadable.
    """
    path = Path(directory)
    out = Inspection(path=str(path))
    add = out.findings.append
    cfg_path, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    config = _read_config(cfg_path)
    if config is None:
        add(Finding("all", "error", f"no {ADAPTER_CONFIG}: vLLM answers 404 'No adapter found', PEFT and SGLang fail"))
        return out
    out.config = config
    if extra := extra_weight_files(path):
        add(Finding("all", "error", f"extra safetensors files {extra}: SGLang loads every *.safetensors in the directory, so lorasync refuses it; save the adapter to a directory of its own"))
    if (path / "adapter_model.bin").exists():
        add(Finding("all", "warning", "adapter_model.bin present: pickle-based; lorasync never reads it"))
    header = _read_header(weights)
    if header is None:
        add(Finding("all", "error", f"no {ADAPTER_WEIGHTS}: vLLM fails with 'doesn't contain tensors'"))
        return out
    ranks: dict[str, int] = {}
    sides: dict[str, set[str]] = {}
    dtypes = set()
    for key, info in header.items():
        dtypes.add(info["dtype"])
        out.nbytes += int(info["data_offsets"][1]) - int(info["data_offsets"][0])
        parsed = split_saved_key(key)
        if parsed is None:
            add(Finding("all", "error", f"{key} is no LoRA weight key: vLLM raises 'unsupported LoRA weight'"))
            continue
        module, side, segment = parsed
        if segment:
            add(Finding("vllm", "error", f"{key} keeps PEFT's adapter-name segment; save with Adapter.save or save_pretrained"))
        shape = info["shape"]
        if len(shape) != 2:  # no rank to read: lora_A is [r, in], lora_B [out, r]
            raise ShapeMismatchError(
                f"{key} has shape {shape}: a LoRA factor is 2-D (lora_A [r, in], lora_B [out, r]); lorasync and the engines "
                f"serve linear and embedding LoRA only: export the adapter's linear LoRA again ({_RESAVE})", key=key)
        r = shape[0] if side == "A" else shape[-1]
        sides.setdefault(module, set()).add(side)
        if ranks.setdefault(module, r) != r:
            add(Finding("all", "error", f"{module}: lora_A and lora_B disagree on the rank ({ranks[module]} vs {r})"))
    for module, have in sides.items():
        if have != {"A", "B"}:
            add(Finding("all", "error", f"{module} has only lora_{''.join(sorted(have))}"))
    out.ranks = ranks
    out.modules = sorted(ranks)
    fused = {m for m in ranks if m.endswith(".base_layer") or m.endswith(".experts")}
    # PEFT's fused expert factors have experts x r rows: the LoRA rank is the config's, not theirs.
    plain = [v for m, v in ranks.items() if m not in fused]
    configured = config.get("r") if fused and isinstance(config.get("r"), int) else None
    out.rank = max(plain) if plain else configured
    out.dtype = ",".join(sorted(dtypes)) or None
    if len(dtypes) > 1:
        add(Finding("all", "warning", f"mixed dtypes {sorted(dtypes)}"))

    r, alpha = config.get("r"), config.get("lora_alpha")
    rslora = bool(config.get("use_rslora"))
    patterns = bool(config.get("rank_pattern")) or bool(config.get("alpha_pattern"))
    if config.get("use_dora"):
        add(Finding("vllm", "error", "DoRA: 'vLLM does not yet support DoRA'"))
        add(Finding("sglang", "error", "DoRA is not supported"))
    if config.get("bias", "none") != "none":
        add(Finding("vllm", "error", "bias: 'Adapter bias is not supported'"))
        add(Finding("sglang", "error", "bias is not supported"))
    if config.get("modules_to_save"):
        add(Finding("all", "error", "modules_to_save: engines refuse full-module copies"))
    if r is None or alpha is None:
        add(Finding("vllm", "error", "config lacks r or lora_alpha ('Missing required configuration fields')"))
    if out.rank is not None and r is not None and out.rank > r and not config.get("rank_pattern"):
        add(Finding("peft", "error", f"tensors have rank {out.rank} but r={r}: PEFT cannot load the shapes"))
    max_rank = vllm_max_rank
    if out.rank is not None:
        smallest = next((m for m in _VLLM_MAX_RANKS if m >= out.rank), None)
        if max_rank is not None and out.rank > max_rank:
            add(Finding("vllm", "error", f"rank {out.rank} > server --max-lora-rank {max_rank}"))
        add(Finding("vllm", "info", f"needs vLLM --max-lora-rank >= {smallest} (allowed values {_VLLM_MAX_RANKS})"))
        if sglang_max_rank is not None and out.rank > sglang_max_rank:
            add(Finding("sglang", "error", f"rank {out.rank} > server --max-lora-rank {sglang_max_rank}"))
    if rslora:
        add(Finding("vllm", "info", "vLLM applies rsLoRA (alpha/sqrt(r)) globally"))
    if patterns:
        add(Finding("vllm", "warning", "vLLM applies one lora_alpha/r to every module; per-module alpha_pattern scales are lost unless normalized"))
    out.findings += _sglang_findings({m: v for m, v in ranks.items() if m not in fused}, config)
    out.findings += _moe_findings(ranks, fused, config, {k: v["shape"] for k, v in header.items()})
    leaves = {m.rsplit(".", 1)[-1] for m in ranks}
    if leaves & {"embed_tokens", "lm_head"}:
        add(Finding("all", "warning", "embedding/lm_head LoRA: support differs by engine version"))
    out.findings += _lorasync_findings(path, header)
    return out


def _lorasync_findings(path: Path, header: dict[str, dict[str, Any]]) -> list[Finding]:
    """What :meth:`Adapter.load` (the validation ``publish`` runs) refuses, as one ``"all"`` error: its
    checks run on meta tensors built from the header, so no verdict says "loads" for what it refuses."""
    import torch

    why = "lorasync refuses to publish it (Adapter.load raises {}): {}"
    # _read_header bounded the shapes and dtypes: building these cannot fail.
    raw = {key: torch.empty(info["shape"], dtype=_SAFETENSORS_DTYPES[info["dtype"]], device="meta") for key, info in header.items()}
    try:
        Adapter._from_saved(path, raw, shapes_only=True)
    except (LoraSyncError, ValueError, TypeError, KeyError, IndexError, RuntimeError, NotImplementedError) as exc:
        # An untyped one means Adapter.load fails the same way: still a refusal, never a "loads".
        return [Finding("all", "error", why.format(type(exc).__name__, str(exc)[:500]))]
    return []


def _moe_findings(ranks: dict[str, int], fused: set[str], config: dict[str, Any], shapes: dict[str, Any]) -> list[Finding]:
    """Each engine's MoE rules (:mod:`lorasync.engines.vllm.moe`, :mod:`lorasync.engines.sglang.rules`)
    on what the files show: PEFT's fused 3-D expert keys, per-expert keys, the router."""
    found = []
    if fused or config.get("target_parameters"):
        try:
            cfg = AdapterConfig.from_peft({**config, "target_parameters": None})
            keys = {k: shape for k, shape in shapes.items() if (split_saved_key(k) or ("", "", "seg"))[2] is None}
            targets_in_keys(keys, config.get("target_parameters") or [], cfg.rank_for, cfg.alpha_for)
        except (LoraSyncError, KeyError, TypeError, ValueError) as exc:
            found.append(Finding("all", "error", f"fused expert factors lorasync cannot convert: {str(exc)[:300]}"))
        found.append(Finding("vllm", "error", "PEFT's fused 3-D expert keys (target_parameters) load only with --enable-mixed-moe-lora-format and is_3d_lora_weight=True; publish through lorasync (Adapter.load converts them to one LoRA per expert, which vLLM loads as it is)"))
        found.append(Finding("sglang", "error", "PEFT's fused 3-D expert keys (target_parameters): SGLang 0.5.23 reads per-expert keys only (mlp.experts.{E}.gate_proj); publish through lorasync, which converts them"))
        found.append(Finding("all", "info", "target_parameters on fused experts: lorasync's Adapter.load and fsdp.export give one LoRA per expert (exact)"))
    experts = {m: v for m, v in ranks.items() if m not in fused and group_experts([m])}
    found += [Finding("vllm", "error", message) for message in vllm_moe.refusals(ranks, version=None)]  # the files name no release
    if experts:
        found.append(Finding("vllm", "info", "MoE expert LoRA: vLLM's CPU build loads it but cannot serve it (Triton-only MoE LoRA kernel); serve on a GPU vLLM"))
        found.append(Finding("sglang", "info", "MoE expert LoRA applies only on a server started with gate_up_proj and down_proj in --lora-target-modules"))
    return found


def _sglang_findings(ranks: dict[str, int], config: dict[str, Any]) -> list[Finding]:
    """SGLang's rules (the ones its client enforces) applied to what the files show."""
    r = config.get("r")
    if not isinstance(r, int) or not ranks:
        return []  # reported above as a missing field / no tensors
    try:
        cfg = AdapterConfig(
            r=r,
            lora_alpha=config.get("lora_alpha") or r,
            use_rslora=bool(config.get("use_rslora")),
            rank_pattern=config.get("rank_pattern") or {},
            alpha_pattern=config.get("alpha_pattern") or {},
        )
        scaling_ok = sglang_rules.safe_scaling(cfg, sorted(ranks))
    except ConfigError:  # malformed patterns: SGLang's scale cannot be trusted either
        scaling_ok = False
    found = []
    for violation in sglang_rules.violations(ranks, r=r, scaling_ok=scaling_ok, pads=False):
        message = violation.message
        if violation.rule == sglang_rules.MIXED_RANKS:
            message += " (lorasync pads them for tensor loads)"
        found.append(Finding("sglang", violation.level, message))
    return found


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[BinaryIO | None]:
    """``path`` open for reading (None if nothing is there), non-blocking and checked on the open
    descriptor: a FIFO blocks ``open`` (and ``safetensors.safe_open``) until a writer comes,
    /dev/zero never ends, and a check by path before the open could be raced.

    Raises:
        StorageError: not a regular file, or an OSError opening or reading it.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        yield None
        return
    except OSError as exc:
        raise StorageError(f"cannot open {path}: {exc.strerror}; check that it is a readable file", path=str(path)) from exc
    if not stat.S_ISREG(mode := os.fstat(fd).st_mode):  # checked before fdopen, which refuses a directory untyped
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise StorageError(f"{path} is {kind}, not a regular file; inspect reads regular files only: put the adapter's {path.name} there", path=str(path))
    with os.fdopen(fd, "rb") as f:
        try:
            yield f
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc}; check the file and the disk", path=str(path)) from exc


def _read_config(path: Path) -> dict[str, Any] | None:
    """``adapter_config.json`` whose fields inspect reads have the right JSON types (None if missing).

    Raises:
        ConfigError: empty, too large, not UTF-8, not JSON, not an object, or a field of the wrong type.
        StorageError: not a regular file, or unreadable.
    """
    with _opened(path) as f:
        if f is None:
            return None
        data = f.read(_MAX_CONFIG + 1)

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{path} {what}; write it with Adapter.save or PEFT save_pretrained", path=str(path))

    if len(data) > _MAX_CONFIG:
        raise bad(f"is over {_MAX_CONFIG // 2**20} MiB, not a PEFT adapter config")
    if not data.strip():
        raise bad("is empty")
    try:
        config = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise bad(f"is not UTF-8 JSON ({str(exc)[:120]})") from exc
    if not isinstance(config, dict):
        raise bad(f"holds a JSON {type(config).__name__}, not the object PEFT writes")
    if _depth(config) > _MAX_DEPTH:
        raise bad(f"nests deeper than {_MAX_DEPTH} levels")
    for name, (types, expected) in _FIELDS.items():
        value = config.get(name)
        if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            raise bad(f"has {name}={json.dumps(value)[:60]}; {name} must be {expected}")
    return config


def _depth(value: Any) -> int:
    """How deep JSON containers nest in ``value`` (up to just past the bound), without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= _MAX_DEPTH:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _read_header(path: Path) -> dict[str, dict[str, Any]] | None:
    """A safetensors file's entries ``{key: {dtype, shape, data_offsets}}`` (None if missing), checked as
    safetensors checks them (offsets tile the data exactly) without reading tensor data.

    Raises:
        AdapterError: not a valid safetensors file.
        StorageError: not a regular file, or unreadable.
    """
    def bad(what: str) -> AdapterError:
        return AdapterError(f"{path} is not a valid safetensors file: {what}; {_RESAVE}, or copy it again if it was cut short", path=str(path))

    with _opened(path) as f:
        if f is None:
            return None
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, too short for the 8-byte header length")
        hlen = int.from_bytes(head, "little")
        if hlen > _MAX_HEADER or 8 + hlen > size:
            raise bad(f"its header length {hlen} does not fit a {size}-byte file")
        raw = f.read(hlen)
    if len(raw) != hlen:
        raise bad("it changed size while it was read")
    try:
        header = json.loads(raw.decode("utf-8"))  # a NaN can only sit where a type check below refuses it
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise bad(f"its header is not UTF-8 JSON ({str(exc)[:120]})") from exc
    if not isinstance(header, dict) or not isinstance(header.pop("__metadata__", {}), dict):
        raise bad("its header is not a JSON object of tensors (and __metadata__ an object)")
    for key, info in header.items():
        if why := _entry_problem(info):
            raise bad(f"{key}: {why}")
    end = 0
    for key, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        begin, stop = info["data_offsets"]
        if begin != end:
            raise bad(f"{key}: its data starts at byte {begin}, not {end} (a gap or an overlap)")
        end = stop
    if 8 + hlen + end != size:
        raise bad(f"the tensors cover {end} bytes but {size - 8 - hlen} follow the header (truncated or padded)")
    return header


def _entry_problem(info: Any) -> str | None:
    """Why one header entry is not ``{dtype, shape, data_offsets}`` that fit each other; None if fine."""
    if not isinstance(info, dict):
        return "not an object"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _SAFETENSORS_DTYPES:  # what Adapter.load reads
        return f"dtype {str(dtype)[:40]!r} is none lorasync reads ({', '.join(_SAFETENSORS_DTYPES)})"
    itemsize = _SAFETENSORS_DTYPES[dtype].itemsize
    ints = lambda v, n=None: isinstance(v, list) and (n is None or len(v) == n) and all(type(x) is int and x >= 0 for x in v)  # noqa: E731
    if not ints(shape) or not ints(offsets, 2):
        return f"shape {str(shape)[:60]} / data_offsets {str(offsets)[:60]} are not lists of non-negative integers"
    count, span = 1, 1
    for d in shape:
        count, span = count * d, span * max(d, 1)
    if span >= 2**63:  # torch (and safetensors) cannot describe it, even with a 0 dimension
        return f"shape {str(shape)[:60]} is larger than any tensor can be"
    if offsets[1] - offsets[0] != count * itemsize:
        return f"data_offsets {offsets} do not hold shape {shape} of {dtype} ({count * itemsize} bytes)"
    return None
