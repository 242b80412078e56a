"""Publish from ``transformers.Trainer`` and TRL trainers: :class:`LoraSyncCallback`.

TRL's trainers (``SFTTrainer``, ``GRPOTrainer``, ``DPOTrainer``...) are ``transformers.Trainer``
subclasses, so one ``TrainerCallback`` serves them all. After every optimizer step (or every
``every``-th one) the callback exports the trainer's PEFT adapter with
:func:`lorasync.exporters.fsdp.export`, publishes it as version ``state.global_step`` (plus
``version_offset``) and puts what happened into the trainer's logs (``lorasync/*`` keys in
``state.log_history`` and in what later callbacks' ``on_log`` receive).

Distributed runs: export is collective under FSDP/ZeRO-3, so every rank runs it (and the
verification forward); only the world's process zero publishes, then tells every rank whether it
failed (:func:`lorasync.distributed._agree.agree_on_error`), so a failure that stops training
stops every rank at the same step instead of leaving the others in the next collective.

Lifetime: the Publisher the callback makes is closed when training ends, when a publish of its
own raises, by :meth:`LoraSyncCallback.close` (or leaving ``with LoraSyncCallback(...)``), when
the next ``train()`` begins on the thread a failed one ran on, and as a last resort when the
callback is garbage-collected (at exit the process's end releases it). ``transformers`` (5.x)
calls no callback when ``trainer.train()`` raises elsewhere (a data collator, the model, another
callback): ``on_train_end`` runs only after a finished loop, there is no ``on_exception`` event,
and a notebook keeps the traceback (so the trainer and its callbacks) alive. ``train()`` runs on
its caller's thread until it returns or raises, so a callback whose training began on this thread
and never ended is left over from a failed ``train()``: the next ``on_train_begin`` there (the
same callback's or a new one's) closes its publisher first, and a rerun with the same ``run=``
takes the run over. One ``train()`` hands one fresh ``TrainerState`` to every callback, so
callbacks that began with the same state are siblings in one trainer (one per engine group), not
left over. To release it at once, wrap ``trainer.train()`` in the ``with`` form, or call
``close()`` in your ``except``/``finally``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from transformers import TrainerCallback

from lorasync.adapter._probe import Probe, check_atol, check_max_tokens
from lorasync.publisher._publisher import Publisher
from lorasync.publisher._report import PublishReport
from lorasync.publisher._retention import _count
from lorasync.engines._engine import Engine
from lorasync.errors import BlockingCallError, ConfigError, LoraSyncError
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
            error, on every rank of a distributed run) or ``"warn"`` (log a warning and keep
            training; engines keep serving their previous version).
        publish_on_train_end (`bool`): publish the final step when ``every`` skipped it.
        adapter_name (`str`): the PEFT adapter to export.
        keep_reports (`int | None`): how many reports ``reports`` and ``failures`` keep, newest
            last (default 100; None keeps every one, which grows by one report per publish).
        transport, keep, root, run, base: passed to :class:`~lorasync.Publisher` when the
            callback makes it (``run=`` resumes a run after a restart).

    Attributes:
        reports (`list[PublishReport]`): the newest ``keep_reports`` publishes (process zero).
        failures (`list[PublishReport]`): the newest ``keep_reports`` publishes that failed on
            some engine, kept apart so that later successes do not push them out.
        publish_count, failure_count (`int`): every publish and every failed one of the run,
            including those no longer kept.
        publisher (`Publisher | None`): the publisher in use; None once the callback closed the
            one it made.

    Raises:
        ConfigError: bad options (at construction).

    Example:
        >>> with LoraSyncCallback(["vllm:http://127.0.0.1:8000"], name="policy") as sync:  # doctest: +SKIP
        ...     trainer = SFTTrainer(model, args=args, train_dataset=ds, peft_config=lora, callbacks=[sync])
        ...     trainer.train()  # the publisher is closed when this block ends, also if train() raised
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
        keep_reports: int | None = 100,
        transport: str = "auto",
        keep: int = 2,
        root: str | os.PathLike[str] | None = None,
        run: str | None = None,
        base: Any = None,
    ) -> None:
        _count("every", every, minimum=1, what="publish every N optimizer steps")
        _count("version_offset", version_offset, minimum=0, what="added to the trainer's global_step")
        if keep_reports is not None:
            _count("keep_reports", keep_reports, minimum=1, what="reports kept in callback.reports, or None for all")
        if on_error not in _ON_ERROR:
            raise ConfigError(f"on_error must be one of {_ON_ERROR}, got {on_error!r}")
        if verify_prompt_ids is not None and not list(verify_prompt_ids):
            raise ConfigError("verify_prompt_ids is empty; pass a few token ids or None")
        # Checked here, not at the first verified publish in the middle of training.
        check_max_tokens(verify_max_tokens, what="verify_max_tokens")
        check_atol(verify_atol, what="verify_atol")
        self._given = engines if isinstance(engines, Publisher) else None
        self._engines = None if self._given is not None else engines
        self._publisher_options = dict(name=name, transport=transport, keep=keep, root=root, run=run, base=base)
        self.every = every
        self.version_offset = version_offset
        self.verify_prompt_ids = None if verify_prompt_ids is None else [int(t) for t in verify_prompt_ids]
        self.verify_max_tokens = verify_max_tokens
        self.verify_atol = verify_atol
        self.on_error = on_error
        self.publish_on_train_end = publish_on_train_end
        self.adapter_name = adapter_name
        self.keep_reports = keep_reports
        self.reports: list[PublishReport] = []
        self.failures: list[PublishReport] = []
        self.publish_count = 0
        self.failure_count = 0
        self._last_step: int | None = None
        self._pending: dict[str, float] = {}
        # The Publisher this callback makes lives in a holder the finalizer may reference: the
        # finalizer must not keep the callback itself alive.
        self._owned = _Owned(given=self._given)
        _ALL.add(self._owned)
        # Not at exit: by then the executors its close needs are shut down, and the process's end
        # lets go of the loop thread, the connections and the run's lock anyway.
        weakref.finalize(self, self._owned.let_go).atexit = False

    @property
    def publisher(self) -> Publisher | None:
        """The Publisher in use (the one passed in, or the one made at train begin)."""
        return self._owned.publisher

    def close(self) -> None:
        """Close the Publisher this callback made (idempotent; a Publisher passed in is the
        caller's to close). Call it when ``trainer.train()`` raised, or use ``with``.

        Raises:
            BlockingCallError: called from async code that runs the publisher (see
                :meth:`lorasync.Publisher.close`).
        """
        self._owned.close()

    def __enter__(self) -> LoraSyncCallback:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- TrainerCallback events --------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _close_left_over(self._owned, state)
        self._owned.began(state)
        if self.publisher is None and state.is_world_process_zero:
            # Made here, not in __init__: only process zero talks to engines. A train() that
            # raised earlier left its publisher open: a second train() goes on with it.
            self._owned.publisher = Publisher(self._engines, **self._publisher_options)  # type: ignore[arg-type]

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.global_step % self.every == 0:
            with self._closing_on_error():
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
            self._owned.close()

    # -- the work ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _closing_on_error(self) -> Iterator[None]:
        # Training stops when an event raises, and Trainer calls no event after that.
        try:
            yield
        except BaseException:
            self._owned.close_quietly()
            raise

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
        failure: LoraSyncError | None = None
        if state.is_world_process_zero and self.publisher is not None:
            try:
                failure = self._publish_here(adapter, version, probe, export_s)
            except LoraSyncError as exc:
                failure = exc
        if _world_size() > 1:  # every rank stops at this step, or none does
            from lorasync.distributed._agree import agree_on_error

            failure = agree_on_error(failure, src=0)
        if failure is not None:
            raise failure

    def _publish_here(self, adapter: Any, version: int, probe: Probe | None, export_s: float) -> LoraSyncError | None:
        """Process zero's publish; returns the error training must stop with, if any."""
        assert self.publisher is not None
        report = self.publisher.publish(adapter, version=version, verify=probe)
        self._record(report)
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
            return None
        if self.on_error == "raise":
            try:
                report.raise_for_errors()
            except LoraSyncError as exc:
                return exc
        log.warning("publish of %s failed on %d engine(s); they keep serving their previous version:\n%s", report.served_name, len(report.failed), report)
        return None

    def _record(self, report: PublishReport) -> None:
        # Bounded: one report per step over a 100k-step run would otherwise stay in memory.
        self.publish_count += 1
        self.reports.append(report)
        if not report.ok:
            self.failure_count += 1
            self.failures.append(report)
        if self.keep_reports is not None:
            del self.reports[: -self.keep_reports]
            del self.failures[: -self.keep_reports]

    def _probe(self, model: Any) -> Probe:
        was_training = model.training
        model.eval()  # no dropout in the reference continuation
        try:
            return Probe.from_model(model, self.verify_prompt_ids or [], max_tokens=self.verify_max_tokens, atol=self.verify_atol)
        finally:
            model.train(was_training)


class _Owned:
    """The Publisher a callback made, closed once by whichever comes first: train end, a
    failed publish or ``close()``; let go of without waiting by the callback's finalizer
    (garbage collection)."""

    def __init__(self, *, given: Publisher | None) -> None:
        self.publisher = given
        self._given = given
        self.training_on: int | None = None  # the thread whose train() began and did not end yet
        # The TrainerState that train() passed (weakly where it can be): it tells a sibling
        # callback of the same train() from one a failed, earlier train() left over.
        self._state: Callable[[], Any] | None = None

    def began(self, state: Any) -> None:
        """Mark this callback's training as begun on this thread, by the ``train()`` of ``state``."""
        self.training_on = threading.get_ident()
        try:
            self._state = weakref.ref(state)
        except TypeError:  # a state that takes no weak reference: held until training ends
            self._state = lambda: state

    def left_over_by(self, state: Any) -> bool:
        """Whether this callback began training on this thread in a ``train()`` other than the
        one ``state`` belongs to (and never ended it: that ``train()`` raised)."""
        if self.training_on != threading.get_ident():
            return False
        return self._state is None or self._state() is not state

    def close(self) -> None:
        self.training_on = None
        self._state = None
        publisher = self.publisher
        if publisher is None or publisher is self._given:
            return
        self.publisher = None
        publisher.close()

    def let_go(self) -> None:
        """The callback's finalizer: let go of the publisher it made without waiting for anything.
        The collector runs finalizers in whatever thread allocates, holding whatever that thread
        holds (a publisher's loop thread inside a store sweep, say); a ``close()`` there waits for
        engine calls and locks that may never come. The publisher's own release runs instead
        (``Publisher._let_go_now``): its run is free at once, its loop thread ends by itself and
        closes the clients it made; versions it left loaded are found again by the next
        publisher from the engine's listing."""
        self.training_on = None
        self._state = None
        publisher, self.publisher = self.publisher, self._given
        if publisher is not None and publisher is not self._given:
            publisher._let_go_now()

    def close_quietly(self) -> None:
        """:meth:`close` where no caller can take an error: an event that is already raising, or
        a callback a failed ``train()`` left over. Called from async code that runs the
        publisher, it hands the close to a thread of its own, where it cannot deadlock."""
        publisher = self.publisher
        try:
            self.close()
        except BlockingCallError:
            threading.Thread(target=publisher.close, name="lorasync-callback-close", daemon=True).start()  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - nobody to raise to; say it instead
            log.warning("closing the callback's publisher failed: %s: %s", type(exc).__name__, exc)


#: Every callback's holder (weakly): a train() that begins finds those a failed one left open.
_ALL: weakref.WeakSet[_Owned] = weakref.WeakSet()


def _close_left_over(beginning: _Owned, state: Any) -> None:
    """Close the publishers of callbacks whose ``train()`` began on this thread and never ended.

    ``train()`` runs on its caller's thread until it returns or raises, and one that returns
    called ``on_train_end`` (which closed its publisher): so on this thread, a callback still
    marked as training while another ``train()`` begins belongs to one that raised. Another
    ``train()``: one whose ``state`` differs; callbacks that began with this ``state`` are the
    beginning callback's siblings in the same trainer.
    """
    for owned in list(_ALL):
        if owned is not beginning and owned.left_over_by(state):
            owned.close_quietly()


def _world_size() -> int:
    import torch.distributed as dist

    return int(dist.get_world_size()) if dist.is_available() and dist.is_initialized() else 1
