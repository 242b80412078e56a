"""The function API: ``publish_adapter`` and ``apublish_adapter``, each with a throwaway
:class:`~lorasync.Publisher` (as ``httpx.get`` opens a throwaway client).

Calls without ``run=`` share one run of the process per root (their versions retire each
other). Calls of one name at once take turns on it (:class:`_Turn`): two live stores cannot own
one run, and two throwaway publishers on one run would retire and collect each other's versions
mid-publish. A forked child forgets the parent's runs and turns and takes its own.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager

from lorasync.adapter._names import validate_name
from lorasync.adapter._probe import Probe
from lorasync.publisher._publisher import AdapterLike, Publisher
from lorasync.publisher._report import PublishReport
from lorasync.publisher._retention import Retention
from lorasync.publisher._session import aclose_all
from lorasync.engines._engine import Engine
from lorasync.engines._group import EngineGroup
from lorasync.errors import ConfigError
from lorasync.transports._base_weights import BaseWeights
from lorasync.transports._store import default_root, new_run_id

__all__ = ["apublish_adapter", "publish_adapter"]


def publish_adapter(
    adapter: AdapterLike,
    engines: Iterable[Engine | str] | Engine | str,
    *,
    name: str,
    version: int,
    transport: str = "auto",
    keep: int = 2,
    verify: Probe | None = None,
    root: str | os.PathLike[str] | None = None,
    run: str | None = None,
    base: BaseWeights | str | os.PathLike[str] | None = None,
) -> PublishReport:
    """Publish ``adapter`` as ``name@v<version>`` to every engine and report what happened.

    Stateless: versions already loaded on each engine are read from the engine itself, so a
    restarted trainer keeps monotonic versions and retention. Calls of one process share one run
    in the store (per root and name) unless ``run=`` says otherwise; calls of one name at once
    take turns on it (to publish to several engines at once, pass them all to one call). For
    every-step use, keep a :class:`Publisher` (it caches capabilities and state).

    Args:
        adapter: an :class:`Adapter`, or a PEFT model / state dict (exported first).
        engines: engine clients or specs like ``"vllm:http://127.0.0.1:8000"``.
        name (`str`): adapter name (ASCII letters, digits, ``._-``).
        version (`int`): monotonic version, e.g. the trainer step.
        transport (`str`): ``"auto"``, ``"disk"``, ``"ipc"`` or ``"merged"``.
        keep (`int`): versions kept loaded per engine.
        verify (`Probe`, *optional*): checked through each engine after loading.
        root: disk transport root. run: the store run. base: pristine base weights for the merged fallback.

    Returns:
        `PublishReport`: ``report.served_name`` is the name to request; ``report.ok`` tells
        whether every engine serves it.

    Raises:
        InvalidNameError, ConfigError, AdapterError: bad arguments (nothing was sent).
            ConfigError also when called from a coroutine while an :func:`apublish_adapter` of
            the same name runs on that event loop (await that instead).

    Example:
        >>> report = publish_adapter(adapter, ["vllm:http://127.0.0.1:8000"], name="policy", version=12)  # doctest: +SKIP
        >>> report.served_name
        'policy@v12'
    """
    # A throwaway publisher retires before it returns (nothing would wait for it afterwards).
    retention = Retention(keep=keep, background=False)
    with _turn(root, name, run) as chosen:
        publisher = Publisher(engines, name=name, transport=transport, root=root, run=chosen, base=base, verify=verify, retention=retention)
        try:
            return publisher.publish(adapter, version=version)
        finally:
            publisher._release()  # the caller's engine objects stay open
            for made in publisher._made:  # the clients it made from specs (a router's workers too) do not
                made.close()


async def apublish_adapter(
    adapter: AdapterLike,
    engines: Iterable[Engine | str] | Engine | str,
    *,
    name: str,
    version: int,
    transport: str = "auto",
    keep: int = 2,
    verify: Probe | None = None,
    root: str | os.PathLike[str] | None = None,
    run: str | None = None,
    base: BaseWeights | str | os.PathLike[str] | None = None,
) -> PublishReport:
    """Async twin of :func:`publish_adapter`. Engines given as specs are closed before it returns."""
    specs = [engines] if isinstance(engines, (Engine, EngineGroup, str)) else list(engines)
    retention = Retention(keep=keep, background=False)
    async with _aturn(root, name, run) as chosen:
        publisher = Publisher(specs, name=name, transport=transport, root=root, run=chosen, base=base, verify=verify, retention=retention)
        try:
            return await publisher.apublish(adapter, version=version)
        finally:
            publisher._release()  # its loop thread never started: nothing here blocks
            # Clients this call made from specs (a router spec: one per worker) are its own; the
            # caller's engine objects stay open.
            await aclose_all(publisher._made)


class _Turn:
    """Whose turn it is on the process's run of one root and name: a lock that sync callers wait
    for and coroutines poll (cancellation-safe: taking it never awaits), with its holder's
    thread, so a sync call from the holder's own thread refuses instead of waiting for ever."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.thread: int | None = None

    def take(self, name: str) -> None:
        if not self._lock.acquire(blocking=False):
            if self.thread == threading.get_ident():
                raise ConfigError(
                    f"publish_adapter(name={name!r}) was called from a coroutine while an apublish_adapter of that name runs on "
                    "this thread's event loop: waiting for it would block that loop for ever; await apublish_adapter instead"
                )
            self._lock.acquire()
        self.thread = threading.get_ident()

    async def atake(self) -> None:
        pause = 0.0005
        while not self._lock.acquire(blocking=False):
            await asyncio.sleep(pause)
            pause = min(2 * pause, 0.01)
        self.thread = threading.get_ident()

    def give(self) -> None:
        self.thread = None
        self._lock.release()


_RUNS: dict[str, str] = {}
_TURNS: dict[tuple[str, str, str], _Turn] = {}
_RUNS_GUARD = threading.Lock()


def _process_run(root: str | os.PathLike[str] | None, name: str, run: str | None) -> tuple[str, _Turn]:
    """The run a stateless call uses (the caller's, or one per process and root: their versions
    retire each other), and the turn on it for ``name``: calls of one (root, name, run) take
    turns, whoever chose the run."""
    key = os.path.abspath(os.fspath(root)) if root is not None else str(default_root())
    with _RUNS_GUARD:
        chosen = run or _RUNS.setdefault(key, new_run_id())
        return chosen, _TURNS.setdefault((key, validate_name(name), chosen), _Turn())


@contextmanager
def _turn(root: str | os.PathLike[str] | None, name: str, run: str | None) -> Iterator[str | None]:
    """The run a sync call uses: the caller's, or the process's (held for the call)."""
    chosen, turn = _process_run(root, name, run)
    turn.take(name)
    try:
        yield chosen
    finally:
        turn.give()


@asynccontextmanager
async def _aturn(root: str | os.PathLike[str] | None, name: str, run: str | None) -> AsyncIterator[str | None]:
    """:func:`_turn` for coroutines."""
    chosen, turn = _process_run(root, name, run)
    await turn.atake()
    try:
        yield chosen
    finally:
        turn.give()


def _forget_after_fork() -> None:
    """A forked child takes runs of its own: the parent's are the parent's (and a turn held by
    one of its threads at the fork would never be given back)."""
    global _RUNS_GUARD
    _RUNS_GUARD = threading.Lock()
    _RUNS.clear()
    _TURNS.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
