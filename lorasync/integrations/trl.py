"""Publish from ``transformers.Trainer`` and TRL trainers: :class:`LoraSyncCallback`.

TRL's trainers (``SFTTrainer``, ``GRPOTrainer``, ``DPOTrainer``...) are ``transformers.Trainer``
subclasses, so one ``TrainerCallback`` serves them all. After every optimizer step (or every
``every``-th one) the callback exports the trainer's PEFT adapter with
:func:`lorasync.exporters.fsdp.export`, publishes it as version ``state.global_step`` (plus
``version_offset``) and puts what happened into the trainer's logs (``lorasync/*`` keys in
``state.log_history`` and in what later callbacks' ``on_log`` receive).

Distributed runs: export is collective under FSDP/ZeRO-3, so every rank runs it (and the
verification forward); only the world's process zero publishes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from transformers import TrainerCallback

from lorasync._probe import Probe
from lorasync._publish import Publisher
from lorasync._report import PublishReport
from lorasync.engines._engine import Engine
from lorasync.errors import ConfigError
from lorasync.exporters.fsdp import export

__all__ = ["LoraSyncCallback"]

log = logging.getLogger(__name__)

_ON_ERROR = ("raise", "warn")


class LoraSyncCallback(TrainerCallback):
    """Export and publish the trainer's LoRA adapter after optimizer steps.

    Args:
        engines: a :class:`~lorasync.Publisher` (used as is, never closed by the callback), or
            engine clients / specs like ``"vllm:http://127.0.0.1:8000"`` (a Publisher is made on
            process zero when training starts and closed when it ends).
        name (`str`): served name prefix; version N is served as ``name@vN``.
        every (`int`): publish every N optimizer steps (default 1: every step).
        version_offset (`int`): added to ``state.global_step``; a re-run against an engine that
            already serves higher versions needs one (versions never go back).
        verify_prompt_ids (`Sequence[int]`, *optional*): when given, the trainer model's greedy
            continuation of these ids is checked through every engine after each load.
        verify_max_tokens (`int`): tokens of the verification continuation.
        verify_atol (`float`): allowed log-prob difference (bf16 engines need ~0.05-0.1). The
            expectation is the model's forward as the trainer runs it: with ``bf16=True``
            (TRL's default) accelerate autocasts it, so an fp32 engine differs by bf16 noise.
        on_error (`str`): ``"raise"`` (default: a failed publish stops training with the typed
            error) or ``"warn"`` (log a warning and keep training; engines keep serving their
            previous version).
        publish_on_train_end (`bool`): publish the final step when ``every`` skipped it.
        adapter_name (`str`): the PEFT adapter to export.
        transport, keep, root, base: passed to :class:`~lorasync.Publisher` when the callback
            makes it.

    Raises:
        ConfigError: bad options (at construction).

    Example:
        >>> trainer = SFTTrainer(model, args=args, train_dataset=ds, peft_config=lora,  # doctest: +SKIP
        ...     callbacks=[LoraSyncCallback(["vllm:http://127.0.0.1:8000"], name="policy")])
    """

    def __init__(
        self,
        engines: Publisher | Engine | str | Iterable[Engine | str],
        *,
        name: str = "policy",
        every: int = 1,
        version_offset: int = 0,
        verify_prompt_ids: Sequence[int] | None = None,
        verify_max_tokens: int = 4,
        verify_atol: float = 0.05,
        on_error: str = "raise",
        publish_on_train_end: bool = True,
        adapter_name: str = "default",
        transport: str = "auto",
        keep: int = 2,
        root: str | os.PathLike[str] | None = None,
        base: Any = None,
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise ConfigError(f"every must be an int >= 1 (publish every N optimizer steps), got {every!r}")
        if not isinstance(version_offset, int) or version_offset < 0:
            raise ConfigError(f"version_offset must be an int >= 0, got {version_offset!r}")
        if on_error not in _ON_ERROR:
            raise ConfigError(f"on_error must be one of {_ON_ERROR}, got {on_error!r}")
        if verify_prompt_ids is not None and not list(verify_prompt_ids):
            raise ConfigError("verify_prompt_ids is empty; pass a few token ids or None")
        self._given = engines if isinstance(engines, Publisher) else None
        self._engines = None if self._given is not None else engines
        self._publisher_options = dict(name=name, transport=transport, keep=keep, root=root, base=base)
        self.every = every
        self.version_offset = version_offset
        self.verify_prompt_ids = None if verify_prompt_ids is None else [int(t) for t in verify_prompt_ids]
        self.verify_max_tokens = verify_max_tokens
        self.verify_atol = verify_atol
        self.on_error = on_error
        self.publish_on_train_end = publish_on_train_end
        self.adapter_name = adapter_name
        self.publisher: Publisher | None = self._given
        self.reports: list[PublishReport] = []  # every publish of this run, in order (process zero)
        self._last_step: int | None = None
        self._pending: dict[str, float] = {}

    # -- TrainerCallback events --------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.publisher is None and state.is_world_process_zero:
            # Made here, not in __init__: only process zero talks to engines.
            self.publisher = Publisher(self._engines, **self._publisher_options)  # type: ignore[arg-type]

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.global_step % self.every == 0:
            self._publish(state, model)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if not self._pending or logs is None:
            return
        # Trainer.log appended its entry to log_history just before calling on_log.
        logs.update(self._pending)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self._pending)
        self._pending = {}

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        try:
            if self.publish_on_train_end and state.global_step and self._last_step != state.global_step:
                self._publish(state, model)
            if self._pending:  # published after the last log: keep it in the run's history
                state.log_history.append({**self._pending, "step": state.global_step})
                self._pending = {}
            if self.reports:  # training is over: old versions retired, as the caller will look
                self.reports[-1].settled()
        finally:
            if self._given is None and self.publisher is not None:
                self.publisher.close()
                self.publisher = None

    # -- the work ----------------------------------------------------------------------------

    def _publish(self, state: Any, model: Any) -> None:
        if model is None:
            raise ConfigError("the trainer passed no model to the callback; add LoraSyncCallback through Trainer(callbacks=[...])")
        self._last_step = state.global_step
        version = state.global_step + self.version_offset
        # Collective under FSDP/ZeRO-3: every rank exports and runs the probe forward.
        start = time.perf_counter()
        adapter = export(model, adapter_name=self.adapter_name)
        export_s = time.perf_counter() - start
        probe = self._probe(model) if self.verify_prompt_ids is not None else None
        if not state.is_world_process_zero or self.publisher is None:
            return
        report = self.publisher.publish(adapter, version=version, verify=probe)
        self.reports.append(report)
        self._pending = {
            "lorasync/version": float(version),
            "lorasync/ok": 1.0 if report.ok else 0.0,
            "lorasync/failed_engines": float(len(report.failed)),
            "lorasync/bytes_moved": float(report.bytes_moved),
            "lorasync/export_ms": 1000.0 * export_s,
            "lorasync/publish_ms": 1000.0 * report.timings.get("total", 0.0),
        }
        if report.ok:
            log.info("published %s to %d engine(s)", report.served_name, len(report.results))
            return
        if self.on_error == "raise":
            # Training stops here and Trainer never calls on_train_end: release what we made.
            if self._given is None:
                self.publisher.close()
                self.publisher = None
            report.raise_for_errors()
        log.warning("publish of %s failed on %d engine(s); they keep serving their previous version:\n%s", report.served_name, len(report.failed), report)

    def _probe(self, model: Any) -> Probe:
        was_training = model.training
        model.eval()  # no dropout in the reference continuation
        try:
            return Probe.from_model(model, self.verify_prompt_ids or [], max_tokens=self.verify_max_tokens, atol=self.verify_atol)
        finally:
            model.train(was_training)
