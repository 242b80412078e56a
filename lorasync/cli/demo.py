"""``lorasync demo``: train a tiny LoRA for a few steps and publish every step.

By default everything runs in this process: a tiny local model, a PEFT trainer and the embedded
PEFT engine. ``--engine vllm:http://127.0.0.1:8000`` publishes to a running vLLM instead (its
``--model`` must be the base given with ``--base``, e.g. one made by ``--make-base DIR``).

Re-runnable against the same engine: versions start above the newest ``NAME@vN`` the engines
already serve. ``--save DIR`` keeps the last adapter for ``lorasync inspect DIR``; the working
directory is removed when the demo ends.

The versions it leaves loaded in a running engine keep serving after it ends: their files stay in
the store (``--root``, default ``/dev/shm/lorasync-<uid>``), because vLLM re-reads an evicted
adapter from its path, and a version whose files were gone killed the engine. The next publish of
the name (a re-run of the demo) removes them once the engine no longer lists them.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorasync.cli._common import TRANSPORT_HELP, emit, plain, publish_exit_code, validate_engine_specs

__all__ = ["DemoRun", "register", "run_demo"]

log = logging.getLogger("lorasync.cli")


@dataclass
class DemoRun:
    """What :func:`run_demo` did: one report and one loss (of the published weights) per step."""

    reports: list[Any] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    saved: str | None = None


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="train a tiny LoRA and publish it after every step", description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", action="append", default=[], metavar="SPEC", help="engine spec like vllm:http://127.0.0.1:8000 (repeatable); default: the embedded PEFT engine")
    p.add_argument("--base", metavar="DIR", help="base model directory (default: build a tiny one in a temp dir)")
    p.add_argument("--make-base", metavar="DIR", help="only write the tiny base model to DIR (to start vLLM on it) and exit")
    p.add_argument("--steps", type=int, default=5, help="training steps, one publish each (default 5)")
    p.add_argument("--name", default="demo-policy", help="served name prefix (default demo-policy)")
    p.add_argument("--transport", default="auto", choices=("auto", "disk", "ipc", "merged"), help=TRANSPORT_HELP)
    p.add_argument("--root", metavar="DIR", help="disk transport root (default: /dev/shm/lorasync-<uid> with --engine, where the versions left loaded keep their files; the demo's temp dir for the embedded engine)")
    p.add_argument("--save", metavar="DIR", help="save the last published adapter to DIR (for lorasync inspect DIR)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.make_base:
        from lorasync.testing import make_tiny_model

        _quiet_deepspeed_banner()  # save_pretrained imports accelerate, which imports deepspeed where installed
        make_tiny_model(args.make_base)
        emit({"ok": True, "base": args.make_base}, as_json=args.json, text=f"tiny base model written to {args.make_base}", quiet=args.quiet)
        return 0
    run = run_demo(
        engines=args.engine, base=args.base, steps=args.steps, name=args.name, transport=args.transport,
        root=args.root, save=args.save, echo=not (args.json or args.quiet),
    )
    code = publish_exit_code(run.reports)
    if args.json:
        steps = [{"loss": loss, **r.to_dict()} for loss, r in zip(run.losses, run.reports)]
        emit({"ok": code == 0, "exit_code": code, "saved": run.saved, "steps": steps}, as_json=True)
    return code


def run_demo(
    *,
    engines: list[str] | None = None,
    base: str | None = None,
    steps: int = 5,
    name: str = "demo-policy",
    transport: str = "auto",
    root: str | None = None,
    save: str | None = None,
    echo: bool = True,
) -> DemoRun:
    """Train the tiny LoRA ``steps`` steps, publishing after each; stops at the first failure.

    Args:
        engines: engine specs (default: the embedded PEFT engine on the base).
        base: base model directory (default: a tiny one built in a temp dir).
        steps: training steps.
        name: served name prefix.
        transport: the publisher's transport.
        root: disk transport root (default: the user's store, ``/dev/shm/lorasync-<uid>``, when
            ``engines`` are given, so that the versions left loaded there keep their files after
            the demo; the demo's temp dir for the embedded engine, which ends with it).
        save: directory to save the last adapter to.
        echo: print progress for people.

    Returns:
        `DemoRun`: one PublishReport and one loss per step run, and where the adapter was saved.

    Raises:
        ConfigError: bad steps, a missing base directory, a malformed engine spec.
        EngineError: an engine cannot be reached before training starts.
    """
    from lorasync.errors import ConfigError

    say = print if echo else (lambda *a, **k: None)
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"--steps must be a positive integer, got {steps!r}")
    specs = validate_engine_specs(list(engines or []))
    if base is not None and not (Path(base) / "config.json").is_file():
        why = "does not exist" if not Path(base).exists() else "has no config.json"
        raise ConfigError(f"--base {base} {why}; pass a local model directory, or make one with `lorasync demo --make-base DIR`")

    workdir = Path(tempfile.mkdtemp(prefix="lorasync-demo-"))
    try:
        return _run(specs, base, steps, name, transport, root, save, workdir, say)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(specs: list[str], base: str | None, steps: int, name: str, transport: str, root: str | None, save: str | None, workdir: Path, say: Any) -> DemoRun:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    _quiet_deepspeed_banner()

    from lorasync import Probe, Publisher
    from lorasync.adapter._names import parse_served_name
    from lorasync.engines import connect
    from lorasync.engines._registry import engine_list
    from lorasync.exporters.fsdp import export
    from lorasync.testing import make_peft_model, make_tiny_model

    if base is None:
        base = str(workdir / "base")
        make_tiny_model(base)
        say(f"built a tiny GQA Llama at {base}")
    # Engines first: an unknown kind or an unreachable server fails before any training.
    # A router spec stands for each server behind it (engine_list): the demo lists and publishes to each.
    clients = [connect("peft", base_model_path=base)] if not specs else engine_list(specs, what="the demo")
    served = [parse_served_name(n) for c in clients for n in c.list_adapters()]
    start = max((v for parsed in served if parsed and parsed[0] == name for v in [parsed[1]]), default=0)
    if start:
        say(f"the engines already serve {name}@v{start}; this run publishes v{start + 1}..v{start + steps}")
    # make_peft_model drops the FutureWarning peft causes (is_gradient_checkpointing): not the user's.
    trainer = make_peft_model(AutoModelForCausalLM.from_pretrained(base), r=8, alpha=16, std=0.02)
    # An engine of its own (the embedded PEFT one) ends with the demo, so its files may go with the
    # temp dir. A running engine keeps the versions the demo leaves loaded and re-reads them from
    # their path (vLLM's LRU reload): their files must outlive the demo, where retention collects
    # them once no engine lists them (the store's orphan sweep, at the next publish of the name).
    root = root or (None if specs else str(workdir / "adapters"))
    publisher = Publisher(clients, name=name, transport=transport, root=root, base=base, keep=2)

    # A toy objective: make the model continue a fixed prompt with a fixed target sequence.
    torch.manual_seed(0)
    prompt = [11, 42, 77, 105, 300]
    target = [200, 201, 202, 203]
    ids = torch.tensor([prompt + target])
    labels = torch.tensor([[-100] * len(prompt) + target])  # learn the continuation only
    optim = torch.optim.Adam([p for n, p in trainer.named_parameters() if "lora_" in n], lr=1e-3)
    run = DemoRun()
    adapter = None
    try:
        for step in range(1, steps + 1):
            trainer.train()
            trainer(input_ids=ids, labels=labels).loss.backward()
            optim.step()
            optim.zero_grad()
            trainer.eval()
            with torch.no_grad():  # the loss of the weights being published
                loss = float(trainer(input_ids=ids, labels=labels).loss)
            adapter = export(trainer, base_model_name_or_path=base)
            probe = Probe.from_model(trainer, prompt, max_tokens=4, atol=0.02)
            report = publisher.publish(adapter, version=start + step, verify=probe)
            log.info("step %d: published %s ok=%s", step, report.served_name, report.ok)
            say(f"\nstep {step}: loss {loss:.4f}, greedy continuation {list(probe.expected_ids)} (target {target})")
            say(report)
            run.reports.append(report)
            run.losses.append(loss)
            if not report.ok:
                say(f"\nstopping: {report.served_name} failed on {len(report.failed)} engine(s); they keep serving their previous version")
                break
    finally:
        publisher.close()
    if save and adapter is not None:
        adapter.save(save)
        run.saved = str(save)
        say(f"\nlast adapter saved to {save}; check it with: lorasync inspect {save}")
    if run.reports and all(r.ok for r in run.reports):
        say("\nall engines serve exactly the trained weights")
    if specs and run.reports:
        say(f"the versions left loaded keep their files under {publisher.store.root} while an engine lists them")
    return run


class _DropCpuBanner(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU")


def _quiet_deepspeed_banner() -> None:
    """Drop deepspeed's "Setting accelerator to CPU" banner (its logger ``DeepSpeed``), which it
    logs when accelerate's ``save_pretrained`` path imports it on a machine without a GPU: the
    demo runs on CPU on purpose. Its other messages stay."""
    ds = logging.getLogger("DeepSpeed")  # deepspeed configures this same logger when imported
    if not any(isinstance(f, _DropCpuBanner) for f in ds.filters):
        ds.addFilter(_DropCpuBanner())
