"""Fixtures for publisher tests: a tiny base on disk, trainer PEFT models, the in-process engine."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # The tiny model's matmuls are ~40x slower with 2 threads on a busy 2-core box.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def trainer(tiny_model_dir):
    """Factory: a PEFT model over a fresh copy of the tiny base with seeded random LoRA."""
    from transformers import AutoModelForCausalLM

    from lorasync.testing import make_peft_model

    def make(seed: int = 1, **kwargs):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        return make_peft_model(base, seed=seed, **kwargs)

    return make


@pytest.fixture
def peft_engine(tiny_model_dir):
    from lorasync.engines import connect

    return connect("peft", base_model_path=tiny_model_dir)


PROMPTS = ([5, 17, 99, 230, 41], [300, 12, 7], [64, 65, 66, 67, 68, 69])


def reference(model, prompt, n=6):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()
