"""Fixtures for the fleet tests: trainers over the tiny base, and the in-process PEFT engine with
an adapter limit that counts its loads (a real engine: only the counter is added)."""

from __future__ import annotations

import pytest
import torch

from lorasync.engines.peft import PeftEngine


class CountingEngine(PeftEngine):
    """The PEFT engine, counting the adapters loaded into it (by tensors or from files)."""

    loads: list[str]

    def load_adapter_tensors(self, name, adapter):
        self.loads.append(name)
        super().load_adapter_tensors(name, adapter)

    def load_adapter(self, name, path):
        self.loads.append(name)
        super().load_adapter(name, path)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def trainer(tiny_model_dir):
    """Factory: a PEFT model (a tenant's trainer) over a fresh copy of the tiny base."""
    from transformers import AutoModelForCausalLM

    from lorasync.testing import make_peft_model

    def make(seed: int = 1):
        return make_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), seed=seed)

    return make


@pytest.fixture
def engine(tiny_model_dir):
    """The PEFT engine with 3 adapter slots."""
    e = CountingEngine(base_model_path=tiny_model_dir, max_loras=3)
    e.loads = []
    yield e
    e.close()
