"""A trainer that publishes from an optimizer step hook is refused on every publish, for ever,
with an AdapterChangedError that says the tensors changed while they were hashed and written
(they did not).

torch runs an optimizer's own step hooks inside its step wrapper: per-optimizer *post* hooks run
after the step's writes are done but *before* the global post hooks, one of which is lorasync's
_after_step; per-optimizer *pre* hooks run after the global pre hooks, one of which is lorasync's
_before_step. So a publish from `optimizer.register_step_post_hook(...)` ("publish after each
step") or `optimizer.register_step_pre_hook(...)` ("publish the weights before the next step
changes them") always finds the optimizer in lorasync's running-step table with its wrapper frame
on the stack (the walk of _on_stack finds it), and the torn-read watch refuses the publish,
although the tensors are between two steps and nothing writes them. Nothing is ever published.

The same holds for a publish from the step's *closure* (`optimizer.step(closure)`, which the
optimizer calls before it updates anything): PyTorch Lightning's automatic optimization runs
`training_step`, `backward` and `on_before_optimizer_step` inside such a closure, so a
LightningModule that publishes from `training_step` every N steps is refused every time.

Run: python tests/fleet/repros/publish_from_optimizer_step_hook_refused_forever.py
Exits 1 when the bug shows.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from lorasync import Fleet
from lorasync.engines.peft import PeftEngine
from lorasync.exporters.fsdp import export
from lorasync.testing import make_tiny_model
from tests.reliability._trust import lora_params, optimizer_step, same, served_lora, state, trainer

root = Path(tempfile.mkdtemp())
make_tiny_model(root / "m")
problems = []
engine = PeftEngine(base_model_path=root / "m")
for kind in ("post", "pre", "closure"):
    model = trainer(root / "m", seed=1)
    optimizer = torch.optim.AdamW(lora_params(model), lr=0.05, fused=True)
    with Fleet([engine], root=root / f"store-{kind}", transport="disk") as fleet:
        fleet.register(kind, keep=2, grace=0.0)
        version = [0]
        results = []

        def publish_between_steps(opt, args, kwargs):
            # The weights are those of one whole step here: the previous step finished, the next
            # has not begun writing (post hook: after this step's writes; pre hook: before them).
            version[0] += 1
            expected = state(model)
            report = fleet.publish({kind: export(model)}, versions={kind: version[0]})[kind]
            results.append((report, expected, served_lora(engine, report.served_name) if report.ok else None))

        if kind == "post":
            optimizer.register_step_post_hook(publish_between_steps)
        elif kind == "pre":
            optimizer.register_step_pre_hook(publish_between_steps)
        for seed in range(1, 4):
            if kind == "closure":  # Lightning-style: the training step runs inside optimizer.step

                def closure(seed=seed):
                    publish_between_steps(optimizer, (), {})  # before this step's update: between steps
                    gen = torch.Generator().manual_seed(seed)
                    for p in lora_params(model):
                        p.grad = torch.randn(p.shape, generator=gen)
                    return torch.zeros(())

                optimizer.step(closure)
            else:
                optimizer_step(optimizer, model, seed=seed)
        for report, expected, served in results:
            print(f"{kind} hook, v{report.version if report.ok else '-'}:", report.status, repr(report.error)[:140])
            if report.status != "loaded" or not same(served, expected):
                problems.append(f"publish from a step {kind} hook: {report.status} ({type(report.error).__name__})")
    for name in engine.list_adapters():
        engine.unload_adapter(name)
engine.close()
for p in problems:
    print("BUG:", p)
sys.exit(1 if problems else 0)
