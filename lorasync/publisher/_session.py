"""The publisher's life around its publishes: pins and leases, ``collect``, ``close`` and the
context managers, sync and async, each behind the one guard of :mod:`lorasync.runtime._lifecycle`
(design invariant 10: no call hangs). :class:`~lorasync.Publisher` inherits it; its constructor
makes the parts this class uses (listed below as annotations).

* Pins never wait: a pin is a counter under a lock held for the update only, so ``pin``,
  ``unpin`` and ``lease`` (and their ``a``-twins) are safe anywhere, also from a coroutine next to
  a running ``apublish`` on the same loop or from inside the publisher's own call. They are not
  refused there: a refusal that depended on whether a publish had reached the loop yet gave one
  program two outcomes.
* ``close`` is idempotent. It refuses new calls, fails the calls waiting for the publisher's lock
  at once (``PublisherClosedError``), lets the call in flight finish, retires what has drained
  (bounded), then closes connections and stops the loop thread.
* In a forked child, ``close``/``aclose`` let go of the parent's copy without touching anything
  the parent still uses (loop, sockets, store); every other call is a ``PublisherClosedError``.
* A publisher collected without ``close`` gives back what it owns (:func:`_let_go`, a
  ``weakref.finalize``): its loop thread and loop (threads, descriptors), its run in the store
  (another publisher may take it over), the engine clients it made from specs. Not at exit: the
  process's end releases all of that anyway, and waiting for a retirement then would hold the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from lorasync.publisher._aftercare import Aftercare
from lorasync.runtime._lifecycle import Closing, Lifecycle, async_entry, blocking
from lorasync.runtime._loop import LoopThread, to_thread_untracked
from lorasync.runtime._looplock import LoopLock, held
from lorasync.adapter._names import parse_served_name, served_name, validate_version
from lorasync.engines._engine import Engine
from lorasync.engines._hosts import server_key
from lorasync.errors import ConfigError, LoraSyncError, VerificationError
from lorasync.transports._store import DiskStore
from lorasync.transports.disk import DiskTransport

__all__ = ["PublisherLife", "aclose_all", "refuse_duplicates"]

_SERVED_AS_KEPT = 4096  # "unchanged" versions remembered for lease(); one small entry each


class PublisherLife(Closing):
    """The lifecycle half of :class:`~lorasync.Publisher` (see the module docstring)."""

    name: str
    engines: list[Engine]
    _made: list[Engine]  # the engines it made from specs (its own to close)
    store: DiskStore
    _disk: DiskTransport
    _pins: dict[int, int]
    _pins_guard: threading.Lock
    _lock: LoopLock
    _loop: LoopThread
    _life: Lifecycle
    _care: Aftercare

    def _start_life(self) -> None:
        """Make the parts this class uses (called by the publisher's constructor)."""
        self._pins = {}
        self._served_as: dict[int, int] = {}  # version -> the earlier version whose name serves its content
        self._reported_ok: dict[int, None] = {}  # versions whose last publish's report was ok (bounded, oldest first)
        self._unverified: dict[int, str | None] = {}  # versions whose last publish failed verification or was cancelled (lease refuses them)
        self._on_served: Callable[[int, str, str], None] | None = None  # a Fleet's tenant: see _note_served
        self._pins_guard = threading.Lock()  # held for a dict update only, never across an await
        self._lock = LoopLock()
        self._loop = LoopThread()
        self._life = Lifecycle(own_loops=self._own_loops, on_fork=self._forget_after_fork)
        # Only what the publisher owns, never the publisher itself (it would never be collected).
        self._finalizer = weakref.finalize(self, _let_go, self._loop, self.store, list(self._made), os.getpid())
        self._finalizer.atexit = False

    def _let_go_now(self) -> None:
        """What collecting this publisher does (:func:`_let_go`), now: for a finalizer of its
        owner (the TRL callback's), where ``close()`` could wait forever. Never waits."""
        self._finalizer()

    def _sync_guard(self, call: str, twin: str) -> None:
        """The guard ``report.settled()`` passes (it may run after ``close``)."""
        self._life.check_sync(call, twin, must_be_open=False)

    def pin(self, version: int) -> None:
        """Never retire ``version`` (on any engine) until :meth:`unpin`; pins nest.

        Never waits, so it is safe from a coroutine too (:meth:`apin` is the same call).

        Raises:
            PublisherClosedError: the publisher was closed.
        """
        self._life.check_open("pin()")
        self._add_pin(validate_version(version))

    def unpin(self, version: int) -> None:
        """Undo one :meth:`pin`; the version retires on the next publish once it is outside the
        window. After ``close`` it does nothing. Never waits (safe from a coroutine)."""
        self._drop_pin(validate_version(version))

    async def apin(self, version: int) -> None:
        """Async twin of :meth:`pin` (it never waits: pins take effect at once)."""
        self._life.check_open("pub.apin()")
        self._add_pin(validate_version(version))

    async def aunpin(self, version: int) -> None:
        """Async twin of :meth:`unpin`."""
        self._drop_pin(validate_version(version))

    @contextlib.contextmanager
    def lease(self, version: int) -> Iterator[str]:
        """Pin ``version`` for the ``with`` block (rollouts that run on it); yields the name that
        serves it, as its report's ``served_name`` says: an earlier version's name where the
        publish of ``version`` was "unchanged" (that version is pinned then), the plain name in
        place. Never waits, so a plain ``with`` is safe in a coroutine too (``alease`` is the
        same lease).

        Raises:
            PublisherClosedError: the publisher was closed.

        Raises:
            VerificationError: the last publish of ``version`` failed its verification (it is not served).

        Example:
            >>> with pub.lease(step) as model:  # doctest: +SKIP
            ...     rollouts = sample(model=model)
        """
        self._life.check_open("lease()")
        held = self._hold(version)
        try:
            yield self._name_of(held)
        finally:
            self._drop_pin(held)

    @contextlib.asynccontextmanager
    async def alease(self, version: int) -> AsyncIterator[str]:
        """Async twin of :meth:`lease`: ``async with pub.alease(step) as model: ...``."""
        self._life.check_open("pub.alease()")
        held = self._hold(version)
        try:
            yield self._name_of(held)
        finally:
            self._drop_pin(held)

    def _note_served(self, version: int, served: str, content_hash: str) -> None:
        """Remember which version's name serves what ``version`` published (bounded)."""
        parsed = parse_served_name(served)
        with self._pins_guard:
            if parsed is not None and parsed[0] == self.name and parsed[1] != version:
                self._served_as[version] = parsed[1]
                while len(self._served_as) > _SERVED_AS_KEPT:
                    del self._served_as[next(iter(self._served_as))]
            else:
                self._served_as.pop(version, None)
            self._unverified.pop(version, None)
            self._reported_ok[version] = None
            while len(self._reported_ok) > _SERVED_AS_KEPT:
                del self._reported_ok[next(iter(self._reported_ok))]
        if self._on_served is not None:  # before the previous version retires (a Fleet's Tenant.version)
            self._on_served(version, served, content_hash)

    def _note_unverified(self, version: int, *, cancelled: bool = False) -> None:
        """``version``'s publish failed verification on some engine (``cancelled``: was cancelled
        before any engine recorded it): it is not served there, so :meth:`lease` refuses it until
        a publish of it is ok (design invariant 11)."""
        with self._pins_guard:
            self._served_as.pop(version, None)
            self._reported_ok.pop(version, None)
            self._unverified[version] = "cancelled" if cancelled else None
            while len(self._unverified) > _SERVED_AS_KEPT:
                del self._unverified[next(iter(self._unverified))]

    @contextlib.contextmanager
    def _cancel_noted(self, version: int, *, recorded: Callable[[], bool]) -> Iterator[None]:
        """A publish of ``version`` cancelled anywhere before ``recorded()`` (every engine
        recorded it) leaves it refused by :meth:`lease` until a publish of it is ok; one whose
        report was ok already (this call's, cancelled in its aftercare, or an earlier one's, as
        for an "unchanged" version served under an earlier name) stays leased as that report says."""
        try:
            yield
        except asyncio.CancelledError:
            with self._pins_guard:
                reported = version in self._reported_ok
            if not reported and not recorded():
                self._note_unverified(version, cancelled=True)
            raise

    def _hold(self, version: int) -> int:
        """Pin what serves ``version`` for a lease and return the version pinned (an earlier one
        where ``version``'s publish was "unchanged"). Every lease goes through here, a Fleet
        tenant's too, so every lease refuses what :meth:`_serving` refuses.

        Raises:
            VerificationError: ``version``'s last publish failed its verification.
            InvalidNameError: ``version`` is not an int >= 0.
        """
        held = self._serving(validate_version(version))
        self._add_pin(held)
        return held

    def _serving(self, version: int) -> int:
        with self._pins_guard:
            if version in self._unverified:
                why = "was cancelled before any engine served it" if self._unverified[version] else "did not pass its verification (see its report)"
                raise VerificationError(
                    f"{self.name} v{version} {why}, so it is not served; lease the version of the last ok report, or publish this one again",
                    adapter=served_name(self.name, version),
                )
            return self._served_as.get(version, version)

    def _name_of(self, version: int) -> str:
        return self.name if getattr(self, "in_place", False) else served_name(self.name, version)

    def _add_pin(self, version: int) -> None:
        with self._pins_guard:
            self._pins[version] = self._pins.get(version, 0) + 1

    def _drop_pin(self, version: int) -> None:
        with self._pins_guard:
            left = self._pins.get(version, 0) - 1
            if left > 0:
                self._pins[version] = left
            else:
                self._pins.pop(version, None)

    @property
    def pinned(self) -> frozenset[int]:
        with self._pins_guard:
            return frozenset(self._pins)

    @blocking("await pub.acollect()")
    def collect(self) -> dict[str, list[str]]:
        """Retire what has drained since the last publish (and collect its files) now.

        Returns:
            ``{"retired": [...], "deferred": [...]}`` over all engines.
        """

    @async_entry("pub.acollect()")
    async def acollect(self, *, closing: bool = False) -> dict[str, list[str]]:
        """Async twin of :meth:`collect`."""
        async with held(self._lock):
            finished = await self._care.previous_settled()
            return await self._care.retire_all(closing=closing, resync=not finished)

    def close(self) -> None:
        """Retire what has drained, close the engines' connections and stop the publisher's
        event loop. Versions still in use stay loaded, with their files.

        Idempotent. Calls waiting for the publisher's lock get ``PublisherClosedError`` at once;
        the call in flight finishes; later calls get ``PublisherClosedError``. In a forked child
        it only lets go of the parent's copy (nothing shared is touched).

        Raises:
            BlockingCallError: in async code that runs this publisher (use :meth:`aclose` or
                ``async with Publisher(...)``).
        """
        if self._life.forked:
            self._life.let_go_in_child()
            return
        if self._life.open:
            self._life.check_sync("close()", "await pub.aclose()` (or `async with Publisher(...)`")
        if not self._life.begin_close():
            return
        try:
            self._lock.refuse(lambda: self._life.closed_error("a call waiting for the publisher"))
            if self._loop.running or self._care.background.pending:
                with contextlib.suppress(LoraSyncError):
                    self._loop.run(self._close_out())
            self._disk.settle_blocking()  # apublish's cancelled writes, when no loop of its own ran
        finally:
            self._shutdown()
            for engine in self.engines:
                engine.close()
            self._life.closed()
            self._finalizer.detach()

    async def aclose(self) -> None:
        """Async twin of :meth:`close`, for publishers driven with :meth:`apublish`."""
        if self._life.forked:
            self._life.let_go_in_child()
            return
        if self._life.open:
            with self._life.inside("pub.aclose()"):
                pass  # refuses a close from inside the publisher's own call (it would wait for itself)
        if not self._life.begin_close():
            return
        try:
            self._lock.refuse(lambda: self._life.closed_error("a call waiting for the publisher"))
            with contextlib.suppress(LoraSyncError):
                await self._close_out()
        finally:
            await aclose_all(self.engines)
            if self._loop.running:
                with contextlib.suppress(LoraSyncError):
                    await self._loop.arun(aclose_all(self.engines))  # async clients opened on its loop
            await to_thread_untracked(self._loop.stop)
            self.store.close()
            self._life.closed()
            self._finalizer.detach()

    async def _close_out(self) -> None:
        async with held(self._lock, closer=True):
            await self._care.close_out()
            await self._disk.settle()  # a cancelled publish's write removes what it wrote first

    def _release(self) -> None:
        """Let go of the loop thread and the store, not of the engines (the function API's
        throwaway publisher: the caller's engine objects stay open)."""
        if self._life.forked:
            self._life.let_go_in_child()
            return
        if not self._life.begin_close():
            return
        self._lock.refuse(lambda: self._life.closed_error("a call waiting for the publisher"))
        # Not waiting for a cancelled write here (called from async code): the process-wide lock
        # of its version orders it before any later write of that version.
        self._shutdown()
        self._life.closed()
        self._finalizer.detach()

    def _shutdown(self) -> None:
        # Async clients opened on the publisher's loop are closed on it before it stops.
        if self._loop.running:
            with contextlib.suppress(LoraSyncError):
                self._loop.run(aclose_all(self.engines))
        self._loop.stop()
        self.store.close()

    def _own_loops(self) -> list[asyncio.AbstractEventLoop | None]:
        return [self._loop.loop, *(engine.home_loop() for engine in self.engines)]

    def _forget_after_fork(self) -> None:
        # In the child: another parent thread may have held any of these at the fork.
        self._pins_guard = threading.Lock()
        self._loop.forget_after_fork()
        care = getattr(self, "_care", None)  # None: forked while the constructor ran
        if care is not None:
            care.background.forget_after_fork()



def _let_go(loop: LoopThread, store: DiskStore, made: list[Engine], pid: int) -> None:
    """A collected publisher's close (see the module docstring). The collector runs it in whatever
    thread allocates, holding whatever locks that thread holds (another publisher's loop thread in
    the middle of a store sweep, say), so nothing here waits or takes a lock: the run is freed
    without waiting (``DiskStore.close``) and the loop thread closes the clients as it ends."""
    if pid != os.getpid():
        return  # a forked child's copy: the loop thread, run and connections are the parent's
    store.close()

    def close_made() -> None:
        for engine in made:
            with contextlib.suppress(Exception):
                engine.close()

    loop.let_go(close_made)


async def aclose_all(engines: Iterable[Engine]) -> None:
    """Close every engine's async connections on the running loop."""
    for engine in engines:
        await engine.aclose()


def refuse_duplicates(engines: list[Engine]) -> None:
    """One publisher drives each engine once: the same object, or one server listed twice
    (whatever the spelling of its URL), would race itself on every publish.

    Raises:
        ConfigError: naming the engine listed twice.
    """
    seen: dict[object, Engine] = {}
    for engine in engines:
        key = _engine_key(engine)
        if key in seen:
            first = seen[key]
            what = "the same engine object" if first is engine else f"{engine!r} and {first!r} (one server)"
            raise ConfigError(
                f"{what} is listed more than once: a publisher drives each engine once, and a second "
                "copy would race the first on every publish. List it once."
            )
        seen[key] = engine


def _engine_key(engine: Engine) -> object:
    # Every spelling of one server is one engine (issue 33 item 22: one vLLM listed as 127.0.0.1
    # and as localhost failed every publish with AdapterAlreadyLoadedError); in-process engines
    # have no server, so two objects are two engines.
    return server_key(engine.url or "") or ("object", id(engine))
