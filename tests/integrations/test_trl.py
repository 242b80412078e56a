"""LoraSyncCallback with a real ``transformers.Trainer`` and a real TRL ``SFTTrainer`` training the
tiny local model on CPU: every optimizer step is published as ``policy@v<global_step>``, the
engine (in-process PEFT, and the real vLLM CPU server) serves exactly the weights the trainer has
at that step, and the trainer's logs carry the report."""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lorasync import Publisher
from lorasync.engines import connect
from lorasync.errors import ConfigError, EngineUnavailableError, LoraSyncError
from lorasync.exporters.fsdp import export
from lorasync.integrations.trl import LoraSyncCallback
from lorasync.testing import TINY_TARGETS

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

PROMPT = [1, 17, 42, 99, 311, 5]


def _greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding by definition: argmax of a full forward, one token at a time."""
    ids, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            tok = int(lp.argmax())
            tokens.append(tok)
            logprobs.append(float(lp[tok]))
            ids.append(tok)
    return tokens, logprobs


class _Witness(TrainerCallback):
    """Runs after LoraSyncCallback each step: what the trainer model says vs what the engine serves."""

    def __init__(self, engine: Any, serve: Any) -> None:
        self.engine, self.serve, self.steps = engine, serve, []

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        was = model.training
        model.eval()
        expected = _greedy(model, PROMPT, 6)
        model.train(was)
        self.steps.append((state.global_step, expected, self.serve(self.engine, f"policy@v{state.global_step}"), export(model, copy=True)))  # a snapshot kept past the step: copied (export does not copy by default)


def _peft_serve(engine: Any, served: str) -> tuple[list[int], list[float]]:
    tokens = engine.generate(PROMPT, adapter=served, max_new_tokens=6)
    return tokens, []


def _dataset(n: int = 8) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(4, 512, (12,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": ids, "attention_mask": [1] * len(ids)})
    return rows


def _args(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    values = dict(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, learning_rate=5e-3,
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
    )
    values.update(overrides)
    return values


def _peft_model(tiny_model_dir: Path) -> Any:
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=list(TINY_TARGETS), lora_dropout=0.0, init_lora_weights="gaussian"))


def _assert_served_as_trained(witness: _Witness, engine_adapters: Any, steps: int) -> None:
    assert [s for s, *_ in witness.steps] == list(range(1, steps + 1))
    continuations = set()
    for step, (tokens, logprobs), (served, served_lp), adapter in witness.steps:
        assert served == tokens, f"step {step}: engine serves {served}, trainer says {tokens}"
        continuations.add(tuple(tokens))
        if engine_adapters is not None:
            loaded = engine_adapters(f"policy@v{step}")
            if loaded is not None:  # retired versions (keep=) are gone; the newest ones are checked
                for key, tensor in adapter.tensors.items():
                    assert torch.equal(loaded[key], tensor), f"step {step}: {key} differs from the trainer's"
        if served_lp:
            assert max(abs(a - b) for a, b in zip(served_lp, logprobs)) < 1e-3


def test_transformers_trainer_publishes_every_step_to_peft_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = connect("peft", base_model_path=tiny_model_dir)
    model = _peft_model(tiny_model_dir)
    callback = LoraSyncCallback([engine], name="policy", keep=4, root=tmp_path / "store", verify_prompt_ids=PROMPT, verify_atol=1e-4)
    witness = _Witness(engine, _peft_serve)
    trainer = Trainer(model=model, args=TrainingArguments(**_args(tmp_path)), train_dataset=_dataset(), callbacks=[callback, witness])
    trainer.train()

    assert [r.version for r in callback.reports] == [1, 2, 3]
    assert all(r.ok for r in callback.reports), [str(r) for r in callback.reports]
    # The probe went through the engine: every publish was verified.
    assert all("verify" in r.results[0].timings for r in callback.reports)
    _assert_served_as_trained(witness, _peft_adapter_tensors(engine), 3)
    # Training moved the weights: the three versions are not one adapter published three times.
    assert len({r.content_hash for r in callback.reports}) == 3
    logged = [h for h in trainer.state.log_history if "lorasync/version" in h]
    assert [(h["step"], h["lorasync/version"], h["lorasync/ok"]) for h in logged] == [(1, 1.0, 1.0), (2, 2.0, 1.0), (3, 3.0, 1.0)]
    assert all("loss" in h and h["lorasync/bytes_moved"] > 0 for h in logged)
    assert callback.publisher is None  # made by the callback, closed at train end


def _peft_adapter_tensors(engine: Any) -> Any:
    """The tensors the PEFT engine holds for a served name, keyed like an exported Adapter."""

    def tensors(served: str) -> dict[str, torch.Tensor] | None:
        slot = engine._slots.get(served)
        if slot is None:
            return None
        out = {}
        for name, param in engine.model.named_parameters():
            marker = f".{slot}."
            if marker in name and ("lora_A" in name or "lora_B" in name):
                out[name.replace(marker, ".")] = param.detach()
        return out

    return tensors


def test_every_n_steps_and_final_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = connect("peft", base_model_path=tiny_model_dir)
    pub = Publisher([engine], name="policy", root=tmp_path / "store", keep=2)
    callback = LoraSyncCallback(pub, every=2, version_offset=100)
    trainer = Trainer(model=_peft_model(tiny_model_dir), args=TrainingArguments(**_args(tmp_path, max_steps=5, logging_steps=5)), train_dataset=_dataset(), callbacks=[callback])
    trainer.train()
    # Steps 2 and 4 on schedule, step 5 because training ended there.
    assert [r.version for r in callback.reports] == [102, 104, 105]
    assert callback.publisher is pub  # a Publisher the caller passed is theirs to close
    assert sorted(n for n in engine.list_adapters() if n.startswith("policy")) == ["policy@v104", "policy@v105"]
    logged = [h for h in trainer.state.log_history if "lorasync/version" in h]
    # logging_steps=5: the log at step 5 carries the newest publish.
    assert logged and logged[-1]["lorasync/version"] == 105.0
    pub.close()


def test_failed_publish_raises_or_warns(tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, dead_url: str) -> None:
    from lorasync.engines.vllm import VLLMEngine

    dead = dead_url
    raising = LoraSyncCallback([VLLMEngine(dead, retries=1, timeout=2)], root=tmp_path / "a")
    trainer = Trainer(model=_peft_model(tiny_model_dir), args=TrainingArguments(**_args(tmp_path)), train_dataset=_dataset(), callbacks=[raising])
    with pytest.raises(EngineUnavailableError):
        trainer.train()
    assert trainer.state.global_step == 1  # stopped at the first failed publish
    assert raising.publisher is None  # the Publisher it made was closed on the way out

    warning = LoraSyncCallback([VLLMEngine(dead, retries=1, timeout=2)], root=tmp_path / "b", on_error="warn")
    trainer = Trainer(model=_peft_model(tiny_model_dir), args=TrainingArguments(**_args(tmp_path, max_steps=2)), train_dataset=_dataset(), callbacks=[warning])
    with caplog.at_level("WARNING", logger="lorasync.integrations.trl"):
        trainer.train()
    assert trainer.state.global_step == 2
    assert [r.ok for r in warning.reports] == [False, False]
    assert "keep serving their previous version" in caplog.text
    assert [h["lorasync/ok"] for h in trainer.state.log_history if "lorasync/ok" in h] == [0.0, 0.0]


def test_bad_options_are_typed() -> None:
    for kwargs in ({"every": 0}, {"every": True}, {"on_error": "ignore"}, {"version_offset": -1}, {"verify_prompt_ids": []}):
        with pytest.raises(ConfigError):
            LoraSyncCallback(["vllm:http://127.0.0.1:1"], **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"verify_max_tokens": 0}, "verify_max_tokens must be an int >= 1"),
        ({"verify_max_tokens": 2.5}, "verify_max_tokens must be an int >= 1"),
        ({"verify_max_tokens": True}, "verify_max_tokens must be an int >= 1"),
        ({"verify_atol": float("nan")}, "verify_atol must be a number >= 0"),
        ({"verify_atol": -0.1}, "verify_atol must be a number >= 0"),
        ({"verify_atol": "0.05"}, "verify_atol must be a number >= 0"),
    ],
)
def test_verification_options_are_checked_when_the_callback_is_made(kwargs, says) -> None:
    # Before, they failed at the first verified publish, in the middle of training.
    with pytest.raises(ConfigError, match=says):
        LoraSyncCallback(["vllm:http://127.0.0.1:1"], verify_prompt_ids=[1, 2], **kwargs)


# -- real TRL --------------------------------------------------------------------------------


def _sft(tiny_model_dir: Path, tmp_path: Path, callbacks: list[Any], steps: int = 3) -> Any:
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    gen = torch.Generator().manual_seed(0)
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(4, 512, (12,), generator=gen)) for _ in range(8)]
    # SFTConfig defaults to bf16 autocast (accelerate patches the model's forward): the trainer's
    # own greedy continuation would then be a bf16 one, and the fp32 engines are compared exactly.
    config = trl.SFTConfig(**_args(tmp_path, max_steps=steps), bf16=False, max_length=32, dataset_text_field="text", packing=False)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=list(TINY_TARGETS), lora_dropout=0.0, init_lora_weights="gaussian")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trl.SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": texts}), processing_class=tokenizer, peft_config=lora, callbacks=callbacks)


def test_trl_sft_trainer_publishes_every_step_to_peft_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = connect("peft", base_model_path=tiny_model_dir)
    callback = LoraSyncCallback([engine], name="policy", keep=4, root=tmp_path / "store", verify_prompt_ids=PROMPT, verify_atol=1e-4)
    witness = _Witness(engine, _peft_serve)
    trainer = _sft(tiny_model_dir, tmp_path, [callback, witness])
    trainer.train()
    assert [r.version for r in callback.reports] == [1, 2, 3]
    assert all(r.ok for r in callback.reports), [str(r) for r in callback.reports]
    _assert_served_as_trained(witness, _peft_adapter_tensors(engine), 3)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3
    assert [h["lorasync/version"] for h in trainer.state.log_history if "lorasync/version" in h] == [1.0, 2.0, 3.0]


@pytest.mark.vllm
def test_trl_sft_trainer_publishes_every_step_to_real_vllm(vllm_server: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = connect("vllm", vllm_server.url, timeout=120)
    name = "trl-policy"
    callback = LoraSyncCallback([engine], name=name, keep=1, root=tmp_path / "store", verify_prompt_ids=PROMPT, verify_atol=1e-3)

    def serve(engine: Any, served: str) -> tuple[list[int], list[float]]:
        return engine.greedy(served.replace("policy", name), PROMPT, 6)

    witness = _Witness(engine, serve)
    trainer = _sft(tiny_model_dir, tmp_path, [callback, witness])
    try:
        trainer.train()
        assert [r.version for r in callback.reports] == [1, 2, 3]
        assert all(r.ok for r in callback.reports), [str(r) for r in callback.reports]
        _assert_served_as_trained(witness, None, 3)
        assert [n for n in engine.list_adapters() if n.startswith(name)] == [f"{name}@v3"]
    finally:
        for served in engine.list_adapters():
            if served.startswith(name):
                engine.unload_adapter(served)
        engine.close()


# -- lifetime: a train() that raises leaves nothing behind (issue 28, item 26) --------------------


class _RaiseAt(TrainerCallback):
    """Another part of training fails mid-run (as a data collator or the model would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise RuntimeError(f"training failed at step {self.step}")


def _lorasync_threads(before: set[Any], *, within: float = 0.0) -> list[str]:
    """Threads started since ``before`` that are still alive (the publisher's loop, its executor)
    after at most ``within`` seconds of waiting for them to end."""
    deadline = time.monotonic() + within
    while True:
        left = sorted(t.name for t in threading.enumerate() if t not in before and t.is_alive())
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _resume(tiny_model_dir: Path, root: Path, run: str, version: int) -> Any:
    """A new Publisher takes the same run over at once and publishes to it."""
    model = _peft_model(tiny_model_dir)
    with Publisher([connect("peft", base_model_path=tiny_model_dir)], name="policy", root=root, run=run, transport="disk") as pub:
        return pub.publish(export(model), version=version)


def test_a_train_that_raises_elsewhere_is_closed_by_the_with_block(tiny_model_dir: Path, tmp_path: Path) -> None:
    before = set(threading.enumerate())
    engine = connect("peft", base_model_path=tiny_model_dir)
    root = tmp_path / "store"
    with pytest.raises(RuntimeError, match="training failed at step 3"):
        with LoraSyncCallback([engine], name="policy", root=root, run="exp42", transport="disk", keep=2) as callback:
            trainer = Trainer(model=_peft_model(tiny_model_dir), args=TrainingArguments(**_args(tmp_path, max_steps=5)),
                              train_dataset=_dataset(), callbacks=[callback, _RaiseAt(3)])
            trainer.train()
    assert [r.version for r in callback.reports] == [1, 2, 3]  # published before the other callback raised
    assert callback.publisher is None
    assert _lorasync_threads(before) == []
    # The run is free at once: a new Publisher resumes it; the store holds that run only.
    report = _resume(tiny_model_dir, root, "exp42", 4)
    assert report.ok, str(report)
    assert [p.name for p in (root / "policy").iterdir()] == ["exp42"]


def test_a_train_that_raised_is_closed_by_close_or_when_the_callback_is_collected(tiny_model_dir: Path, tmp_path: Path) -> None:
    import gc

    before = set(threading.enumerate())
    root = tmp_path / "store"
    for run, release in (("by-close", "close"), ("by-gc", "gc")):
        callback = LoraSyncCallback([connect("peft", base_model_path=tiny_model_dir)], root=root, run=run, transport="disk")
        trainer = Trainer(model=_peft_model(tiny_model_dir), args=TrainingArguments(**_args(tmp_path, max_steps=3)),
                          train_dataset=_dataset(), callbacks=[callback, _RaiseAt(1)])
        with pytest.raises(RuntimeError, match="training failed at step 1"):
            trainer.train()
        assert "lorasync-publisher" in _lorasync_threads(before)  # transformers calls no event on failure
        if release == "close":
            callback.close()
            callback.close()  # idempotent
        else:
            del callback, trainer
            gc.collect()
        # A finalizer never waits (it may run inside a lock its thread holds), so the loop thread
        # a collected callback let go of ends by itself, within a couple of seconds; close() joins it.
        assert _lorasync_threads(before, within=10.0 if release == "gc" else 0.0) == [], release
        assert _resume(tiny_model_dir, root, run, 2).ok, release


def test_an_export_that_raises_in_the_callback_closes_its_publisher(tiny_model_dir: Path, tmp_path: Path) -> None:
    before = set(threading.enumerate())
    callback = LoraSyncCallback([connect("peft", base_model_path=tiny_model_dir)], root=tmp_path / "store", adapter_name="missing")
    trainer = Trainer(model=_peft_model(tiny_model_dir), args=TrainingArguments(**_args(tmp_path)), train_dataset=_dataset(), callbacks=[callback])
    with pytest.raises(LoraSyncError, match="missing"):
        trainer.train()
    assert trainer.state.global_step == 1
    assert callback.publisher is None and _lorasync_threads(before) == []


def test_reports_are_bounded_and_keep_the_failures(tiny_model_dir: Path, tmp_path: Path, dead_url: str) -> None:
    from lorasync.engines.vllm import VLLMEngine

    engine = connect("peft", base_model_path=tiny_model_dir)
    dead = VLLMEngine(dead_url, retries=1, timeout=2)
    pub = Publisher([engine], name="policy", root=tmp_path / "store", keep=1)
    callback = LoraSyncCallback(pub, keep_reports=2, on_error="warn")
    trainer = Trainer(model=_peft_model(tiny_model_dir), args=TrainingArguments(**_args(tmp_path, max_steps=5)),
                      train_dataset=_dataset(), callbacks=[callback])
    trainer.train()
    assert [r.version for r in callback.reports] == [4, 5]  # the newest two of five
    assert (callback.publish_count, callback.failure_count, callback.failures) == (5, 0, [])
    # A failed step is kept in failures while later successes push reports on.
    failing = Publisher([engine, dead], name="policy", root=tmp_path / "store2", keep=1)
    callback = LoraSyncCallback(failing, keep_reports=2, on_error="warn", version_offset=10)
    trainer = Trainer(model=_peft_model(tiny_model_dir), args=TrainingArguments(**_args(tmp_path, max_steps=3)),
                      train_dataset=_dataset(), callbacks=[callback])
    trainer.train()
    assert [r.version for r in callback.reports] == [12, 13]
    assert [r.version for r in callback.failures] == [12, 13] and callback.failure_count == 3
    assert all(isinstance(r.failed[0].error, EngineUnavailableError) for r in callback.failures)
    pub.close()
    failing.close()
    with pytest.raises(ConfigError, match="keep_reports must be an int >= 1"):
        LoraSyncCallback(["vllm:http://127.0.0.1:1"], keep_reports=0)
    assert LoraSyncCallback(["vllm:http://127.0.0.1:1"], keep_reports=None).keep_reports is None


def test_a_failed_publish_stops_every_rank_of_a_distributed_run(tiny_model_dir: Path, tmp_path: Path, dead_url: str) -> None:
    """2 gloo ranks, DDP on CPU: process zero's publish fails at step 1 and every rank's train()
    raises the same typed error there (before, rank 1 went on into the next all-reduce alone)."""
    import json

    from _trl_ranks_worker import train_with_a_dead_engine
    from support import run_distributed

    run_distributed(train_with_a_dead_engine, str(tmp_path), str(tiny_model_dir), dead_url, world_size=2, timeout_s=240)
    outcomes = [json.loads((tmp_path / f"trl-outcome-{rank}.json").read_text()) for rank in range(2)]
    assert [o["world"] for o in outcomes] == [2, 2]
    assert [(o["raised"], o["step"]) for o in outcomes] == [("EngineUnavailableError", 1)] * 2
    assert outcomes[0]["message"] == outcomes[1]["message"]
    assert outcomes[0]["publisher_closed"]


def test_a_rerun_after_a_failed_sft_train_takes_the_same_run_over(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Issue 33 item 14. 090ffbd: the failed train() left its callback's Publisher open (no event
    # follows a failure, and a notebook keeps the traceback, so the callback is never collected):
    # the rerun with the same run= met a live run (ConfigError). A new train() on the thread the
    # failed one ran on closes what a failed train() of any callback left open.
    before = set(threading.enumerate())
    engine = connect("peft", base_model_path=tiny_model_dir)
    root = tmp_path / "store"
    first = LoraSyncCallback([engine], name="policy", root=root, run="exp", transport="disk", keep=1)
    failed = _sft(tiny_model_dir, tmp_path / "a", [first, _RaiseAt(2)], steps=4)
    with pytest.raises(RuntimeError, match="training failed at step 2") as raised:
        failed.train()
    assert [r.version for r in first.reports] == [1, 2] and first.publisher is not None  # kept alive, as a notebook does
    second = LoraSyncCallback([engine], name="policy", root=root, run="exp", transport="disk", keep=1, version_offset=10)
    rerun = _sft(tiny_model_dir, tmp_path / "b", [second], steps=2)
    rerun.train()
    assert first.publisher is None and raised.value is not None
    assert [r.version for r in second.reports] == [11, 12] and all(r.ok for r in second.reports), [str(r) for r in second.reports]
    assert [n for n in engine.list_adapters() if n.startswith("policy")] == ["policy@v12"]
    assert second.publisher is None
    assert [t for t in _lorasync_threads(before) if t.startswith("lorasync")] == []  # TRL may start a telemetry thread
    engine.close()


def test_two_callbacks_in_one_sft_trainer_each_publish_every_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    # 090ffbd's left-over check (a callback training on this thread while a train() begins) took
    # the first of two callbacks in ONE trainer (one per engine group) for a failed train()'s: the
    # second's on_train_begin closed its publisher, and it published nothing, silently, all run.
    # One train() passes one TrainerState to every callback; only another one's is left over.
    engines = [connect("peft", base_model_path=tiny_model_dir) for _ in range(2)]
    callbacks = [LoraSyncCallback([e], name="policy", root=tmp_path / f"store-{i}", keep=4) for i, e in enumerate(engines)]
    witnesses = [_Witness(e, _peft_serve) for e in engines]
    trainer = _sft(tiny_model_dir, tmp_path, [*callbacks, *witnesses])
    trainer.train()
    for callback, witness, engine in zip(callbacks, witnesses, engines):
        assert [r.version for r in callback.reports] == [1, 2, 3] and all(r.ok for r in callback.reports), [str(r) for r in callback.reports]
        _assert_served_as_trained(witness, _peft_adapter_tensors(engine), 3)
        assert callback.publisher is None  # closed by on_train_end
        engine.close()
