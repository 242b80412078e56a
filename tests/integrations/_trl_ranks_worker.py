"""Worker for the multi-rank LoraSyncCallback test: one process per rank, a real gloo group and a
real ``transformers.Trainer`` (DDP on CPU through accelerate). Only process zero holds an engine,
and it is down: the first publish fails. Each rank writes what ``trainer.train()`` raised."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def train_with_a_dead_engine(rank: int, world: int, out: str, tiny_model_dir: str, dead_url: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    from test_trl import _args, _dataset, _peft_model
    from transformers import Trainer, TrainingArguments

    from lorasync.engines.vllm import VLLMEngine
    from lorasync.errors import LoraSyncError
    from lorasync.integrations.trl import LoraSyncCallback

    callback = LoraSyncCallback([VLLMEngine(dead_url, retries=1, timeout=2)], root=Path(out) / f"store-{rank}")
    trainer = Trainer(model=_peft_model(Path(tiny_model_dir)), args=TrainingArguments(**_args(Path(out) / f"r{rank}", max_steps=4, per_device_train_batch_size=2)),
                      train_dataset=_dataset(), callbacks=[callback])
    start = time.monotonic()
    try:
        trainer.train()
        outcome = {"raised": None}
    except LoraSyncError as exc:
        outcome = {"raised": type(exc).__name__, "message": str(exc)}
    outcome.update(seconds=time.monotonic() - start, step=trainer.state.global_step, world=trainer.args.world_size,
                   publisher_closed=callback.publisher is None)
    (Path(out) / f"trl-outcome-{rank}.json").write_text(json.dumps(outcome))
