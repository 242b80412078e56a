"""Check an adapter directory against the loader rules of PEFT, vLLM and SGLang.

``inspect_adapter(dir)`` reads only ``adapter_config.json`` and the safetensors header (no
tensor data, no pickle) and returns, per engine, whether it would load the adapter and how it
would scale it — the problems that otherwise surface as a 500 from the engine, or worse as an
adapter that loads but is scaled differently than in training.

Keys are split by :func:`lorasync._keys.split_saved_key`, and SGLang's verdicts come from
:mod:`lorasync.engines.sglang.rules`, the rules its client and the publisher enforce, so this
report and a publish never disagree.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorasync._adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from lorasync._config import AdapterConfig
from lorasync._keys import split_saved_key
from lorasync.engines.sglang import rules as sglang_rules
from lorasync.errors import ConfigError
from lorasync.wire.dtypes import size_of_name

__all__ = ["Finding", "Inspection", "inspect_adapter"]

_VLLM_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


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
    """
    path = Path(directory)
    out = Inspection(path=str(path))
    add = out.findings.append
    cfg_path, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not cfg_path.is_file():
        add(Finding("all", "error", f"no {ADAPTER_CONFIG}: vLLM answers 404 'No adapter found', PEFT and SGLang fail"))
        return out
    try:
        config = json.loads(cfg_path.read_text())
    except ValueError as exc:
        add(Finding("all", "error", f"{ADAPTER_CONFIG} is not JSON: {exc}"))
        return out
    out.config = config
    extra = sorted(p.name for p in path.glob("*.safetensors") if p.name != ADAPTER_WEIGHTS)
    if extra:
        add(Finding("sglang", "error", f"extra safetensors files {extra}: SGLang loads every *.safetensors in the directory"))
    if (path / "adapter_model.bin").exists():
        add(Finding("all", "warning", "adapter_model.bin present: pickle-based; lorasync never reads it"))
    if not weights.is_file():
        add(Finding("all", "error", f"no {ADAPTER_WEIGHTS}: vLLM fails with 'doesn't contain tensors'"))
        return out
    header = _safetensors_header(weights)
    header.pop("__metadata__", None)
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
        r = shape[0] if side == "A" else shape[-1]
        sides.setdefault(module, set()).add(side)
        if ranks.setdefault(module, r) != r:
            add(Finding("all", "error", f"{module}: lora_A and lora_B disagree on the rank ({ranks[module]} vs {r})"))
    for module, have in sides.items():
        if have != {"A", "B"}:
            add(Finding("all", "error", f"{module} has only lora_{''.join(sorted(have))}"))
    out.ranks = ranks
    out.modules = sorted(ranks)
    out.rank = max(ranks.values()) if ranks else None
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
    out.findings += _sglang_findings(ranks, config)
    leaves = {m.rsplit(".", 1)[-1] for m in ranks}
    if leaves & {"embed_tokens", "lm_head"}:
        add(Finding("all", "warning", "embedding/lm_head LoRA: support differs by engine version"))
    return out


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


def _safetensors_header(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        header = {}
        for key in f.keys():
            sl = f.get_slice(key)
            shape = list(sl.get_shape())
            dtype = str(sl.get_dtype())
            size = 1
            for d in shape:
                size *= d
            header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [0, size * size_of_name(dtype)]}
        return header
