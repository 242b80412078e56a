"""Driving an in-process vLLM's engine core: operations as generators of steps, run sync or async.

An operation of :class:`~lorasync.engines.vllm.inprocess.VLLMInProcessEngine` is a generator
that yields :class:`Step` objects (a method of the engine core, or of the engine itself, with
its arguments) and receives each result, as the HTTP clients' operations yield calls. The
:class:`StepDriver` mixin runs it directly against a ``vllm.LLM``'s engine, or awaits it on the
AsyncLLM's own event loop (its sockets belong to that loop: calls from other threads or loops are
handed over to it). Foreign exceptions become typed errors here, once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lorasync.engines.vllm._errors import INCOMPATIBLE, RANK_REFUSAL, worker_message
from lorasync.engines.vllm._frontend import Frontend
from lorasync.errors import (
    AdapterNotFoundError,
    AdapterRejectedError,
    ConfigError,
    EngineError,
    EngineDeadError,
    IncompatibleAdapterError,
    LoraSyncError,
    RankTooLargeError,
)
from lorasync.runtime._loop import to_thread_untracked

__all__ = ["Op", "Step", "StepDriver"]

T = TypeVar("T")


@dataclass(frozen=True)
class Step:
    """One call an operation wants made: ``method`` of the engine core (or of this engine when
    ``local``) with ``args``."""

    method: str
    args: tuple[Any, ...] = ()
    local: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)


Op = Generator[Step, Any, T]


class StepDriver:
    """Mixin of the drivers; the engine sets ``kind``, ``url``, ``is_async``, ``_core`` and ``_loop``."""

    kind: str
    url: str
    is_async: bool
    _core: Any
    _loop: asyncio.AbstractEventLoop | None
    _frontend: Frontend

    # -- drivers ----------------------------------------------------------------------------------

    def _run(self, op: Op[T]) -> T:
        if self.is_async:
            assert self._loop is not None
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self._loop:
                op.close()
                raise ConfigError(
                    f"{self.kind}: blocking calls on the AsyncLLM's own event loop would deadlock it; use the "
                    "a-prefixed methods (await engine.aload_adapter(...), await publisher.apublish(...))"
                )
            return asyncio.run_coroutine_threadsafe(self._drive_async(op), self._loop).result()
        self._frontend.check_idle(self.kind)
        try:
            step = next(op)
            while True:
                try:
                    result = self._call(step)
                except EngineError as exc:
                    step = op.throw(exc)
                else:
                    step = op.send(result)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    async def _arun(self, op: Op[T]) -> T:
        if not self.is_async:
            return await to_thread_untracked(self._run, op)
        if asyncio.get_running_loop() is self._loop:
            return await self._drive_async(op)
        assert self._loop is not None
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._drive_async(op), self._loop))

    async def _drive_async(self, op: Op[T]) -> T:
        try:
            step = next(op)
            while True:
                try:
                    result = await self._acall(step)
                except EngineError as exc:
                    step = op.throw(exc)
                else:
                    step = op.send(result)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    def _call(self, step: Step) -> Any:
        target = self if step.local else self._core
        try:
            return getattr(target, step.method)(*step.args, **step.kwargs)
        except LoraSyncError:
            raise  # already typed (the engine's own refusals)
        except Exception as exc:
            raise self._translate(exc, step) from exc

    async def _acall(self, step: Step) -> Any:
        try:
            if step.local:
                return await getattr(self, "a" + step.method)(*step.args, **step.kwargs)
            return await getattr(self._core, step.method)(*step.args, **step.kwargs)
        except LoraSyncError:
            raise  # already typed (the engine's own refusals)
        except Exception as exc:
            raise self._translate(exc, step) from exc


    # -- error mapping ------------------------------------------------------------------------------

    def _translate(self, exc: Exception, step: Step) -> EngineError:
        text = f"{type(exc).__name__}: {exc}"
        where = f"{self.kind} ({self.url}): {step.method}"
        if type(exc).__name__ == "EngineDeadError" or "EngineCore encountered an issue" in str(exc):
            return EngineDeadError(
                f"{where} failed because the engine core died ({text}); build a new LLM (and connect the engine to it): "
                "the next publish loads the current version again",
                engine=self.kind,
                url=self.url,
            )
        return EngineError(f"{where} failed: {text}", engine=self.kind, url=self.url, reason=str(exc))

    def _load_error(self, name: str, path: str, exc: EngineError) -> EngineError:
        message = str(getattr(exc, "reason", "") or exc)
        detail = worker_message(message)
        context = {"engine": self.kind, "url": self.url, "adapter": name}
        rank = RANK_REFUSAL.search(message)
        if rank is not None:
            return RankTooLargeError(
                f"{self.kind} refused adapter {name!r}: {detail}; build the LLM with a larger max_lora_rank or "
                f"train/trim the adapter to r <= {rank.group(2)}",
                rank=int(rank.group(1)),
                max_rank=int(rank.group(2)),
                **context,
            )
        if "No adapter found" in message or "doesn't contain tensors" in message or "LoRAAdapterNotFound" in message:
            return AdapterNotFoundError(f"{self.kind} found no adapter at {path} ({detail})", path=path, **context)
        for needle, fix in INCOMPATIBLE:
            if needle in message:
                return IncompatibleAdapterError(
                    f"{self.kind} refused adapter {name!r} from {path}: {detail}; {fix}", reason=detail, **context
                )
        return AdapterRejectedError(
            f"{self.kind} failed to load adapter {name!r} from {path}: {detail}; the served versions are unchanged",
            reason=detail,
            **context,
        )


