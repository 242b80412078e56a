"""Test helpers shipped with lorasync: tiny local models, fake engines and the engine
conformance suite plugins can subclass."""

from lorasync.testing._tiny import TINY_TARGETS, make_peft_model, make_tiny_model, randomize_lora, tiny_config

__all__ = ["TINY_TARGETS", "make_peft_model", "make_tiny_model", "randomize_lora", "tiny_config"]
