"""``lorasync demo``: train a tiny LoRA for a few steps and publish every step.

By default everything runs in this process: a tiny local model, a PEFT trainer and the embedded
PEFT engine. ``--engine vllm:http://127.0.0.1:8000`` publishes to a running vLLM instead (its
``--model`` must be the base given with ``--base``, e.g. one made by ``--make-base DIR``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["register", "run_demo"]


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="train a tiny LoRA and publish it after every step", description=__doc__)
    p.add_argument("--engine", action="append", default=[], metavar="SPEC", help="engine spec like vllm:http://127.0.0.1:8000 (repeatable); default: the embedded PEFT engine")
    p.add_argument("--base", metavar="DIR", help="base model directory (default: build a tiny one in a temp dir)")
    p.add_argument("--make-base", metavar="DIR", help="only write the tiny base model to DIR (to start vLLM on it) and exit")
    p.add_argument("--steps", type=int, default=5, help="training steps, one publish each (default 5)")
    p.add_argument("--transport", default="auto", choices=("auto", "disk", "ipc", "merged"))
    p.add_argument("--root", metavar="DIR", help="disk transport root (default /dev/shm/lorasync)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.make_base:
        from lorasync.testing import make_tiny_model

        make_tiny_model(args.make_base)
        print(f"tiny base model written to {args.make_base}")
        return 0
    reports = run_demo(engines=args.engine, base=args.base, steps=args.steps, transport=args.transport, root=args.root)
    return 0 if all(r.ok for r in reports) else 1


def run_demo(*, engines: list[str] | None = None, base: str | None = None, steps: int = 5, transport: str = "auto", root: str | None = None) -> list[Any]:
    """Run the demo; returns one PublishReport per step."""
    import warnings

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)

    from lorasync import Probe, Publisher
    from lorasync.engines import connect
    from lorasync.exporters.fsdp import export
    from lorasync.testing import make_peft_model, make_tiny_model

    workdir = Path(tempfile.mkdtemp(prefix="lorasync-demo-"))
    if base is None:
        base = str(workdir / "base")
        make_tiny_model(base)
        print(f"built a tiny GQA Llama at {base}")
    trainer = make_peft_model(AutoModelForCausalLM.from_pretrained(base), r=8, alpha=16, std=0.02)
    clients = [connect("peft", base_model_path=base)] if not engines else list(engines)
    publisher = Publisher(clients, name="demo-policy", transport=transport, root=root or str(workdir / "adapters"), base=base, keep=2)

    # A toy objective: make the model continue a fixed prompt with a fixed target sequence.
    torch.manual_seed(0)
    prompt = [11, 42, 77, 105, 300]
    target = [200, 201, 202, 203]
    ids = torch.tensor([prompt + target])
    labels = torch.tensor([[-100] * len(prompt) + target])  # learn the continuation only
    optim = torch.optim.Adam([p for n, p in trainer.named_parameters() if "lora_" in n], lr=1e-2)
    reports = []
    for step in range(1, steps + 1):
        trainer.train()
        loss = trainer(input_ids=ids, labels=labels).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        trainer.eval()
        adapter = export(trainer, base_model_name_or_path=base)
        probe = Probe.from_model(trainer, prompt, max_tokens=4, atol=0.02)
        report = publisher.publish(adapter, version=step, verify=probe)
        print(f"\nstep {step}: loss {loss.item():.4f}, greedy continuation {list(probe.expected_ids)} (target {target})")
        print(report)
        reports.append(report)
    publisher.close()
    ok = all(r.ok for r in reports)
    print("\nall engines serve exactly the trained weights" if ok else "\nsome publishes failed (see above)")
    return reports
