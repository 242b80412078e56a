"""Test helpers shipped with lorasync: tiny local models, fake engines and the engine
conformance suite plugins can subclass.

May import: every package below the top floor; nothing in lorasync imports it.
"""

from typing import Any

from lorasync.testing._fakes import EngineCall, FakeEngine, MemoryEngine
from lorasync.testing._tiny import TINY_TARGETS, make_peft_model, make_tiny_model, randomize_lora, tiny_config
from lorasync.testing._tiny_moe import MoeCase, make_moe_case, make_moe_peft_model, make_tiny_moe_model, tiny_moe_config

__all__ = ["TINY_TARGETS", "make_peft_model", "make_tiny_model", "randomize_lora", "tiny_config"]
__all__ += ["MoeCase", "make_moe_case", "make_moe_peft_model", "make_tiny_moe_model", "tiny_moe_config"]
__all__ += ["EngineCall", "EngineConformance", "FakeEngine", "MemoryEngine", "tiny_llama_adapter"]


def __getattr__(name: str) -> Any:
    # The conformance suite imports pytest; load it only when asked for.
    if name in ("EngineConformance", "tiny_llama_adapter"):
        from lorasync.testing import _conformance

        return getattr(_conformance, name)
    raise AttributeError(f"module 'lorasync.testing' has no attribute {name!r}")
