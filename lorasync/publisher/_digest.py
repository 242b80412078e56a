"""One publish's view of the adapter's bytes: its content hash, computed once by whoever needs it
first; the owned copy the publisher keeps where it may have to put the version back; and whether
the trainer changed the tensors while the publish read them.

The disk transport hashes the bytes in the pass that writes them (:meth:`DiskStore.write_hashed`),
so a disk publish reads the adapter's memory once; engines that take tensors (ipc, merged,
in-place) hash it on its own. Engines of one fan-out run concurrently: the first one to ask
computes, the others wait for that value instead of hashing again. Never carried over from an
earlier publish: the trainer's tensors may have changed in place since (dedup decides on the
bytes of this publish).

**Torn reads** (design invariant 1). An Adapter from a no-copy export *is* the trainer's memory.
If a trainer thread steps the optimizer while a publish reads it, the hash, the bytes written and
the bytes an engine copied can come from different steps. A publish therefore notes, when it
starts, two things that change whenever the tensors do, and compares them after each read of the
trainer's memory (the hash or write pass, an engine's tensor load, the owned copy):

* every tensor's autograd version counter (``Tensor._version``), bumped by every in-place torch
  op on the tensor or any view of its storage: ``add_``, ``copy_``, the foreach and for-loop
  optimizer implementations, ``load_state_dict``;
* the steps of every ``torch.optim.Optimizer`` (global step pre/post hooks, installed once per
  process) whose parameters share storage with the adapter's tensors. Fused optimizer kernels
  (``AdamW(fused=True)``, transformers' default ``adamw_torch_fused``, DeepSpeed/apex fused Adam)
  write without bumping version counters, but every optimizer step passes through these hooks.

A change raises :class:`~lorasync.errors.AdapterChangedError`: the engine that read torn bytes
has the version taken out of service and nothing of it is remembered as servable. Writes that
neither bumps (``param.data`` writes outside an optimizer step, numpy or ctypes views, another
process or device writing the memory) are not seen: export with ``copy=True`` for those, or
publish between steps as the no-copy contract says. Both checks cost microseconds, so zero-copy
stays the hot path; a second hash pass (the only check blind to nothing) would cost ~10 % of a
disk publish.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from lorasync.errors import AdapterChangedError, AdapterError
from lorasync.runtime._lifecycle import CALLER_THREAD
from lorasync.transports._snapshot import owned_copy
from lorasync.runtime._loop import to_thread_untracked

if TYPE_CHECKING:
    import torch

    from lorasync.adapter._adapter import Adapter

__all__ = ["PublishDigest", "refuse_freed", "watch_optimizer_steps"]


class PublishDigest:
    """The content hash, owned copy and torn-read watch of one publish's adapter.

    Args:
        adapter (`Adapter`): what is published.
    """

    def __init__(self, adapter: Adapter, *, value: str | None = None) -> None:
        self.adapter = adapter
        self.value: str | None = value  # known already: an owned copy of bytes hashed under a watch (see of_copy)
        self.seconds = 0.0  # spent in a hashing pass of its own (0 when the write pass gave it)
        self.from_write = False  # the value came from the disk write pass (the files hold exactly the hashed bytes)
        self.torn: str | None = None  # why the hash (or write) pass is not one state of the tensors
        refuse_freed(adapter)
        self._watch = _Watch(adapter)
        self._owned: Adapter | None = None
        self._lock = asyncio.Lock()

    async def get(self, compute: Callable[[], Awaitable[str]] | None = None, *, check: bool = True) -> str:
        """The hash: known, or from ``compute`` (e.g. a write that hashes), or a hashing pass.

        Raises:
            AdapterChangedError: the tensors changed while they were hashed (``check``).
        """
        async with self._lock:
            if self.value is None:
                if compute is not None:
                    self.value = await compute()
                    self.from_write = True
                else:
                    start = time.perf_counter()
                    self.value = await to_thread_untracked(lambda: self.adapter.content_hash)
                    self.seconds += time.perf_counter() - start
                self.torn = self._watch.changed()
            if check and self.torn is not None:
                raise self.error(self.torn, "while it was hashed" + (" and written" if self.from_write else ""))
            return self.value

    async def owned(self) -> Adapter:
        """A copy of the adapter that nothing else writes (taken once per publish): what the
        publisher keeps to put a version back, and what those engines are handed.

        Raises:
            AdapterChangedError: the tensors changed since the publish started.
        """
        async with self._lock:
            if self._owned is None:
                copy = await to_thread_untracked(owned_copy, self.adapter)
                why = self._watch.changed()
                if why is not None:
                    raise self.error(why, "before lorasync's copy of it was complete")
                self._owned = copy
            return self._owned

    # -- before the publish: a Fleet round checks many tenants in worker threads --------------------

    def hash_now(self, hasher: Callable[[Adapter], str]) -> str:
        """Hash the adapter in this thread with ``hasher`` (which must give exactly
        :attr:`Adapter.content_hash`), under this publish's watch, before the publish starts.

        Raises:
            AdapterChangedError: the tensors changed while they were hashed.
        """
        start = time.perf_counter()
        self.value = hasher(self.adapter)
        self.seconds += time.perf_counter() - start
        self.torn = self._watch.changed()
        if self.torn is not None:
            raise self.error(self.torn, "while they were hashed")
        return self.value

    def copy_now(self) -> PublishDigest:
        """The digest of an owned copy taken now, in this thread, with this digest's hash (the
        copy holds exactly the hashed bytes: the watch saw no change from before the hash to the
        end of the copy). What a publish of that copy uses instead of this one.

        Raises:
            AdapterChangedError: the tensors changed since the watch began (a torn copy).
        """
        assert self.value is not None, "hash_now first"
        copy = owned_copy(self.adapter)
        why = self._watch.changed()
        if why is not None:
            raise self.error(why, "before lorasync's copy of it was complete")
        return PublishDigest(copy, value=self.value)

    def changed(self) -> str | None:
        """Why the tensors may differ now from when the publish started (None: they do not)."""
        return self._watch.changed()

    def error(self, why: str, when: str) -> AdapterChangedError:
        return AdapterChangedError(
            f"the adapter's tensors changed {when} ({why}): the engine would have served a mix of two trainer "
            "steps, so this version was not put in service. The Adapter wraps the trainer's own memory "
            "(no-copy export): publish between optimizer steps (after optimizer.step() returns, before the next "
            "one starts), or export a copy to publish while training goes on (fsdp.export(model, copy=True))",
        )


class _Watch:
    """What changes when an adapter's tensors do (see the module docstring)."""

    def __init__(self, adapter: Adapter) -> None:
        watch_optimizer_steps()
        self._tensors = list(adapter.tensors.values())
        self._versions = _versions(self._tensors)
        with _STEPS.lock:
            self._seq = _STEPS.seq
            # Optimizers mid-step right now, but for steps of the thread that is waiting in this very
            # publish (a publish from an optimizer's step hook or closure: that step cannot go on
            # until the publish returns, so its tensors hold still meanwhile).
            self._running = _STEPS.still_running(paused=CALLER_THREAD.get())

    def changed(self) -> str | None:
        now = _versions(self._tensors)
        if now != self._versions and any(b is not None and a != b for a, b in zip(now, self._versions)):
            return "an in-place write to them"
        with _STEPS.lock:
            seq = _STEPS.seq
            began = [ref for n, ref in _STEPS.log if n > self._seq]
            lost = seq - self._seq > len(began)  # more steps than the log keeps
        if seq == self._seq and not self._running:
            return None
        stepped = [opt for opt in (ref() for ref in [*self._running, *began]) if opt is not None]
        for optimizer in stepped:
            if _shares_storage(optimizer, self._tensors):
                return f"a step of {type(optimizer).__name__} over them"
        return "more optimizer steps than lorasync keeps track of" if lost else None


def refuse_freed(adapter: Adapter) -> None:
    """Refuse an adapter whose tensors lost their memory after it was built (no-copy exports
    share the trainer's storage, and FSDP's reshard frees the unsharded parameters'): reading
    them would publish whatever the freed address holds (zeros were served). ~0.4 us a tensor.

    Raises:
        AdapterError: naming the first such tensor, and what to export instead.
    """
    for key, tensor in adapter.tensors.items():
        try:
            short = tensor.untyped_storage().nbytes() < tensor.nbytes
        except (RuntimeError, NotImplementedError, AttributeError):  # no plain storage: the readers decide
            continue
        if short:
            raise AdapterError(
                f"{key} has no memory behind it any more: the trainer freed its storage after the export (FSDP "
                "reshards unsharded parameters when summon_full_params exits or after forward). Nothing was "
                "published. Export and publish while the full parameters are held, or export with copy=True",
                key=key,
            )


def _versions(tensors: list[torch.Tensor]) -> list[int | None]:
    """Every tensor's version counter, None for those without one. A Fleet round reads these for
    every tensor of every tenant twice (``bench fleet``: 16 x 392 tensors); the plain comprehension
    costs a third of the per-tensor call with its ``try`` (~40 against ~140 us a tenant)."""
    try:
        return [t._version for t in tensors]
    except RuntimeError:  # an inference-mode tensor among them has no version counter
        return [_version(t) for t in tensors]


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return int(tensor._version)
    except RuntimeError:  # an inference-mode tensor has no version counter
        return None


def _storages(tensors: list[torch.Tensor]) -> set[int]:
    found = set()
    for tensor in tensors:
        try:
            ptr = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, AttributeError):  # a tensor subclass without plain storage
            continue
        if ptr:
            found.add(ptr)
    return found


def _shares_storage(optimizer: Any, tensors: list[torch.Tensor]) -> bool:
    params = [p for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())]
    return bool(_storages(tensors) & _storages(params))


class _StepLog:
    """Optimizer steps begun in this process: a sequence number per step and the last ones'
    optimizers (weakly held), plus the optimizers mid-step now."""

    KEEP = 256

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seq = 0
        self.log: deque[tuple[int, weakref.ref[Any]]] = deque(maxlen=self.KEEP)
        # id(optimizer) -> (optimizer, the thread stepping it, the frame of its step wrapper)
        self.running: dict[int, tuple[weakref.ref[Any], int, Any]] = {}
        self.installed = False

    def still_running(self, *, paused: int | None = None) -> list[weakref.ref[Any]]:
        """The optimizers mid-step now (under ``lock``). torch runs no post hook when a step
        raises (an OOM, a KeyboardInterrupt the loop handles), so a step is running only while
        the frame that called its pre hook is still on its thread's stack; the others are
        forgotten here (otherwise every later publish would see that optimizer "stepping")."""
        if not self.running:
            return []
        stacks = sys._current_frames()
        for key, (_, thread, frame) in list(self.running.items()):
            if not _on_stack(frame, stacks.get(thread)):
                del self.running[key]
        return [ref for ref, thread, _ in self.running.values() if thread != paused]


def _on_stack(frame: Any, top: Any) -> bool:
    """Whether ``frame`` is on the stack that ``top`` heads (another thread's, which runs on
    between the hops of this walk). CPython 3.11 has been seen here to hand back a function, not a
    frame, from ``f_back`` of such a stack (the CI run of issue 33's Fleet test beside a running
    optimizer): a walk that cannot be read counts as "still running", so the publish refuses as
    torn, never serves on a guess; the next publish walks again."""
    try:
        while top is not None:
            if top is frame:
                return True
            if not isinstance(top, FrameType):
                return True
            top = top.f_back
    except Exception:  # noqa: BLE001 - an unreadable stack is a step that may be running
        return True
    return False


_STEPS = _StepLog()


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    ref = weakref.ref(optimizer)
    caller = sys._getframe(1)  # torch's step wrapper: on the stack until the step returns or raises
    with _STEPS.lock:
        _STEPS.seq += 1
        _STEPS.log.append((_STEPS.seq, ref))
        _STEPS.running[id(optimizer)] = (ref, threading.get_ident(), caller)


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    with _STEPS.lock:
        _STEPS.running.pop(id(optimizer), None)


def watch_optimizer_steps() -> None:
    """Install (once per process) the global ``torch.optim`` step hooks the torn-read check uses.

    They record a counter and a weak reference per optimizer step (about a microsecond each);
    nothing else changes for the trainer.
    """
    if _STEPS.installed:
        return
    with _STEPS.lock:
        if _STEPS.installed:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_before_step)
        register_optimizer_step_post_hook(_after_step)
        _STEPS.installed = True
