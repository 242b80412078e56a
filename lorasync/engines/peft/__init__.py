"""The in-process PEFT engine: :class:`PeftEngine` (registered as ``peft``).

A transformers causal LM with PEFT LoRA adapters, in this Python process. It serves the same role
as a vLLM or SGLang server for tests, demos and small-scale RL loops that run generation next to
the trainer: adapters are loaded by name (from PEFT directories or straight from tensors),
unloaded, listed, and selected per call to :meth:`PeftEngine.generate` /
:meth:`PeftEngine.logprobs`. Base weights can be replaced in place (the merged fallback).

Modules, lowest first: :mod:`._model` (the base model: loading it, finding its parameters, the
``LoraConfig`` an adapter is injected with), :mod:`._errors` (torch, PEFT and OS errors into
typed lorasync errors), :mod:`._slots` (the ``PeftModel`` and which PEFT adapter serves which
name, every change rolled back on failure) and :mod:`.engine` (``PeftEngine``). ``lorasync.engines.peft_local``, the
module's former name, still re-exports ``PeftEngine``.
"""

from lorasync.engines.peft.engine import PeftEngine

__all__ = ["PeftEngine"]
