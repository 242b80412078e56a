"""The torn-read watch reads every tensor's version counter in one pass; an adapter that mixes
inference-mode tensors (no counter) with trained ones is still watched on the trained ones."""

from __future__ import annotations

import torch

from lorasync import Adapter, AdapterConfig
from lorasync.publisher._digest import PublishDigest


def _adapter(first: torch.Tensor) -> Adapter:
    tensors = {
        "base_model.model.layer.q_proj.lora_A.weight": first,
        "base_model.model.layer.q_proj.lora_B.weight": torch.zeros(8, 2),
    }
    return Adapter(tensors, AdapterConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))


def test_an_in_place_write_is_seen_beside_an_inference_mode_tensor():
    with torch.inference_mode():
        frozen = torch.ones(2, 8)
    adapter = _adapter(frozen)
    digest = PublishDigest(adapter)
    assert digest.changed() is None
    adapter.tensors["base_model.model.layer.q_proj.lora_B.weight"].add_(1)
    assert digest.changed() == "an in-place write to them"


def test_a_watch_over_trained_tensors_sees_each_write():
    adapter = _adapter(torch.ones(2, 8))
    digest = PublishDigest(adapter)
    adapter.tensors["base_model.model.layer.q_proj.lora_A.weight"].mul_(2)
    assert digest.changed() == "an in-place write to them"
    assert PublishDigest(adapter).changed() is None


def test_a_step_frame_is_found_on_its_stack_and_an_unreadable_stack_counts_as_running():
    import sys

    from lorasync.publisher._digest import _on_stack

    here = sys._getframe()

    def inner():
        return sys._getframe()

    def nested():
        return _on_stack(here, sys._getframe())

    assert nested()  # the caller's frame is on the running stack
    assert not _on_stack(inner(), sys._getframe())  # a frame that returned is not
    assert not _on_stack(here, None)  # the thread is gone
    # CPython 3.11 has handed back a function from f_back of another thread's stack: never a guess.
    assert _on_stack(here, inner)


def test_an_optimizer_whose_step_raised_is_forgotten_by_the_next_publish():
    """torch runs no post hook when a step raises: the step's frame is gone, so a later publish's
    watch must not see that optimizer stepping for ever (the walk above decides it)."""
    from lorasync.publisher._digest import _STEPS, watch_optimizer_steps

    class Failing(torch.optim.SGD):
        def step(self, closure=None):
            raise MemoryError("the step ran out of memory")

    watch_optimizer_steps()
    param = torch.nn.Parameter(torch.ones(2, 8))
    optimizer = Failing([param], lr=0.1)
    adapter = _adapter(param.detach())
    try:
        optimizer.step()
    except MemoryError:
        pass
    with _STEPS.lock:
        assert id(optimizer) in _STEPS.running  # the pre hook ran, the post hook never did
    digest = PublishDigest(adapter)
    assert digest.changed() is None
    with _STEPS.lock:
        assert id(optimizer) not in _STEPS.running
