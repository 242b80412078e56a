"""CPU stand-ins that let the real Megatron-Core + Megatron-Bridge run on a CPU-only machine.

Test-only peer plumbing (never shipped): the real-peer suite (``bridge_peer.py``) imports this
module first, inside the Megatron venv (scripts/megatron-venv.sh). Each stand-in replaces a piece
of GPU plumbing that LoRA's numerics do not depend on:

- ``transformer_engine.pytorch``: Megatron-Bridge's ``peft/lora_layers.py`` imports it
  unconditionally; an empty module with placeholder classes is enough, since the local
  (non-TransformerEngine) layer spec never builds a TE layer. Megatron-Core is imported first so
  that it still sees TransformerEngine as absent, and peft before that, because peft probes for it.
- Megatron-Core leaves its ``TE*`` classes as ``MagicMock`` (or None) without TE; Megatron-Bridge's
  ``peft/utils.py`` uses them in ``isinstance``, so they become never-matching dummy classes.
- CUDA calls on the forward path: RoPE moves ``inv_freq`` to ``torch.cuda.current_device()``,
  the default causal mask is built with ``device="cuda"``, attention dropout forks the CUDA RNG
  tracker. They are pointed at the CPU (dropout is 0 in these tests, so the RNG fork is a no-op).
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

_INSTALLED = False


def install() -> None:
    """Install every stand-in (idempotent). Call before importing ``megatron.bridge``."""
    global _INSTALLED
    if _INSTALLED:
        return
    import peft  # noqa: F401  # before the TE stand-in: peft probes transformer_engine
    import torch

    import megatron.core
    import megatron.core.extensions.transformer_engine as mte
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.transformer.moe.experts  # noqa: F401
    import megatron.training  # noqa: F401  # reads the TE version when TE is importable

    from unittest.mock import MagicMock

    for name in dir(mte):
        value = getattr(mte, name)
        if name.startswith("TE") and (value is None or isinstance(value, MagicMock)):
            setattr(mte, name, type(name, (), {}))

    te = types.ModuleType("transformer_engine")
    te.__path__ = []  # a package, so submodule imports resolve to the stand-ins below
    te_torch = types.ModuleType("transformer_engine.pytorch")
    te_torch.__path__ = []
    for name in ("Linear", "LayerNormLinear", "GroupedLinear"):
        setattr(te_torch, name, type(name, (), {}))
    te_torch.ops = types.SimpleNamespace(Sequential=type("Sequential", (), {}))
    te_torch.fp8_autocast = lambda **_: contextlib.nullcontext()
    te.pytorch = te_torch
    sys.modules.setdefault("transformer_engine", te)
    sys.modules.setdefault("transformer_engine.pytorch", te_torch)

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]

    import megatron.core.transformer.utils as mutils
    from megatron.core.tensor_parallel import random as mrandom

    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    mutils.get_default_causal_mask = causal_mask
    for name, module in list(sys.modules.items()):  # modules that imported the function by name
        if name.startswith("megatron.") and "get_default_causal_mask" in vars(module):
            module.get_default_causal_mask = causal_mask

    @contextlib.contextmanager
    def fork(self: Any, name: str = "") -> Any:
        yield

    mrandom.CudaRNGStatesTracker.fork = fork  # type: ignore[method-assign]
    _INSTALLED = True
