"""The PEFT engine's failures as lorasync errors: torch, PEFT and OS errors raised while it
loads, serves or updates, and PEFT's silently ignored adapter weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from lorasync.engines.peft._model import KIND
from lorasync.errors import (
    AdapterRejectedError,
    CapacityError,
    EngineError,
    IncompatibleAdapterError,
    LoraSyncError,
)


@contextlib.contextmanager
def translated(op: str, adapter: str | None, *, kind: str = KIND) -> Iterator[None]:
    """Turn torch/PEFT/OS errors raised during ``op`` into lorasync errors."""
    try:
        yield
    except LoraSyncError:
        raise
    except torch.OutOfMemoryError as exc:
        raise CapacityError(
            f"peft engine ran out of memory during {op}: {exc}; unload adapters or use a smaller model",
            engine=kind,
            adapter=adapter,
        ) from exc
    except (ValueError, KeyError, IndexError, TypeError, RuntimeError) as exc:
        if op != "load":
            raise EngineError(f"peft engine failed during {op}: {exc}", engine=kind, adapter=adapter) from exc
        message = str(exc)
        incompatible = "not found in the base model" in message or "size mismatch" in message
        rejected: type[EngineError] = IncompatibleAdapterError if incompatible else AdapterRejectedError
        raise rejected(
            f"the peft engine rejected adapter {adapter!r}: {message}; check that it was trained on this "
            "base model",
            engine=kind,
            adapter=adapter,
        ) from exc
    except OSError as exc:
        failed: type[EngineError] = AdapterRejectedError if op == "load" else EngineError
        raise failed(f"peft engine I/O failed during {op}: {exc}", engine=kind, adapter=adapter) from exc


def check_load_result(result: Any, slot: str, name: str) -> None:
    """PEFT only warns about adapter weights that match no module; refuse them instead."""
    unexpected = [k for k in getattr(result, "unexpected_keys", ()) or () if ".lora_" in k]
    if unexpected:
        shown = ", ".join(k.replace(f".{slot}.", ".") for k in unexpected[:3])
        raise IncompatibleAdapterError(
            f"adapter weights for modules the base model does not have: {shown}"
            + (f" (+{len(unexpected) - 3} more)" if len(unexpected) > 3 else "")
            + "; check that it was trained on this base model",
            engine=KIND,
            adapter=name,
        )
