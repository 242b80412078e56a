"""What callers hand the Megatron exporters, checked at the public entry before anything is
read or allocated: shard keys, the parallel grid, and plain option values.

Every check raises a typed :mod:`lorasync.errors` error naming the argument and what to pass, so a
``tp_size=True`` or ``rank=True`` never reaches torch (where it ended in a bare ``TypeError``),
and a grid far larger than the shards given is refused by arithmetic, never by building it.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lorasync.errors import ConfigError, MissingShardError

__all__ = ["LORA_TYPES", "Grid", "ShardKey", "check_options", "count"]

LORA_TYPES = ("lora", "canonical_lora")


def _kind(value: object) -> str:
    return "a bool" if isinstance(value, bool) else type(value).__name__


def count(name: str, value: object, *, minimum: int = 1, what: str = "") -> int:
    """``value`` as an int >= ``minimum``: any integral number (numpy ints too), never a bool.

    Raises:
        ConfigError: naming ``name``, what it means and what was given.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        hint = f" ({what})" if what else ""
        raise ConfigError(f"{name} must be an int >= {minimum}{hint}, got {value!r} ({_kind(value)})")
    return int(value)


def check_options(
    *,
    rank: Any,
    alpha: Any,
    slot: Any,
    lora_type: Any,
    dtype: Any,
    sizes: dict[str, Any] | None = None,
) -> tuple[int | None, float, int | None]:
    """Validate the exporters' option values (shared by ``export`` and ``export_distributed``).

    Args:
        rank, alpha, slot, lora_type, dtype: as passed to the exporter.
        sizes: ``{"tp_size": ..., ...}`` (None entries mean "infer").

    Returns:
        `tuple`: ``(rank, alpha, slot)`` normalised to plain ``int``/``float`` (numpy scalars in).

    Raises:
        ConfigError: a bool where a number belongs, a non-positive size or rank, a NaN/inf or
            non-positive alpha, an unknown ``lora_type``, a ``dtype`` that is not a float torch dtype.
    """
    if rank is not None:
        rank = count("rank", rank, what="the trained LoRA rank; None keeps the gathered width")
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(alpha) or alpha <= 0:
        raise ConfigError(
            f"alpha must be a finite number > 0 (Megatron's LoRA alpha; scale = alpha / rank), "
            f"got {alpha!r} ({_kind(alpha)})"
        )
    if slot is not None:
        slot = count("slot", slot, minimum=0, what="the MultiLoRA slot index; None for a single adapter")
    if not isinstance(lora_type, str) or lora_type not in LORA_TYPES:
        raise ConfigError(f"lora_type must be one of {LORA_TYPES}, got {lora_type!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError(f"dtype must be a floating torch.dtype such as torch.bfloat16, or None; got {dtype!r}")
    for name, value in (sizes or {}).items():
        if value is not None:
            count(name, value, what="the run's parallel size; None infers it from the shard keys")
    return rank, float(alpha), slot


@dataclass(frozen=True, order=True)
class ShardKey:
    """Coordinates of one rank's shard: pipeline, tensor, expert and virtual-pipeline rank.

    Plain tuples are accepted wherever a key is: ``(pp, tp)``, ``(pp, tp, ep)`` or
    ``(pp, tp, ep, vp)``.
    """

    pp: int = 0
    tp: int = 0
    ep: int = 0
    vp: int = 0

    @classmethod
    def of(cls, key: ShardKey | Sequence[int]) -> ShardKey:
        """Normalise a ``ShardKey`` or a 2-, 3- or 4-tuple of non-negative ints.

        Raises:
            ConfigError: any other form (bools included), or negative ranks.
        """
        ints = isinstance(key, tuple) and all(isinstance(k, numbers.Integral) and not isinstance(k, bool) for k in key)
        if isinstance(key, ShardKey):
            out = key
        elif ints and 2 <= len(key) <= 4:
            out = cls(*(int(k) for k in key))
        else:
            raise ConfigError(
                f"shard key {key!r} must be a ShardKey or a tuple (pp, tp), (pp, tp, ep) or (pp, tp, ep, vp) of ints"
            )
        if min(out.pp, out.tp, out.ep, out.vp) < 0:
            raise ConfigError(f"shard key {key!r} has a negative rank")
        return out


ShardKey.__module__ = "lorasync.exporters.megatron"


@dataclass(frozen=True)
class Grid:
    """Parallel sizes of the run that wrote the shards."""

    pp: int = 1
    tp: int = 1
    ep: int = 1
    vp: int = 1

    @property
    def size(self) -> int:
        return self.pp * self.tp * self.ep * self.vp

    def holds(self, key: ShardKey) -> bool:
        return key.pp < self.pp and key.tp < self.tp and key.ep < self.ep and key.vp < self.vp

    def keys(self) -> Iterator[ShardKey]:
        """Every key of the grid, lazily (a grid may be far larger than memory; itertools.product
        would first copy each range into a tuple)."""
        for p in range(self.pp):
            for t in range(self.tp):
                for e in range(self.ep):
                    for v in range(self.vp):
                        yield ShardKey(p, t, e, v)

    @classmethod
    def of_keys(
        cls,
        keys: Iterable[ShardKey],
        *,
        tp_size: int | None = None,
        pp_size: int | None = None,
        ep_size: int | None = None,
    ) -> Grid:
        """The grid spanned by ``keys`` (explicit sizes win), checked for completeness.

        The check is arithmetic on the grid's size, so a mistyped ``tp_size=10**7`` is refused at
        once instead of listing ten million absent keys.

        Raises:
            MissingShardError: a key of the grid is absent (names up to 8 of them).
            ConfigError: a size that is not a positive int, or a key outside an explicit size.
        """
        present = set(keys)
        if not present:
            raise MissingShardError("no shards given; pass every rank's adapter state dict")
        explicit = {"pp_size": pp_size, "tp_size": tp_size, "ep_size": ep_size}
        for name, value in explicit.items():
            if value is not None:
                count(name, value, what="the run's parallel size; None infers it from the shard keys")
        grid = cls(
            pp=int(pp_size) if pp_size is not None else 1 + max(k.pp for k in present),
            tp=int(tp_size) if tp_size is not None else 1 + max(k.tp for k in present),
            ep=int(ep_size) if ep_size is not None else 1 + max(k.ep for k in present),
            vp=1 + max(k.vp for k in present),
        )
        outside = sorted(k for k in present if not grid.holds(k))
        if outside:
            raise ConfigError(f"shards {outside[:8]} lie outside the grid {grid}; check tp_size/pp_size/ep_size")
        absent = grid.size - len(present)
        if absent:
            # At most len(present) + 8 keys are visited, whatever the grid's size.
            missing = list(itertools.islice((k for k in grid.keys() if k not in present), 8))
            raise MissingShardError(
                f"{absent} of the {grid.size} shard(s) of {grid} are missing ({len(present)} given), "
                f"first {missing}; pass every rank's state dict, or the run's real "
                "tp_size/pp_size/ep_size",
                missing=missing,
            )
        return grid
