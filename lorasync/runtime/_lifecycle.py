"""Where a publisher is in its life, and the one guard every public entry point passes
(design invariant 10: no call hangs).

* Open, closing, closed: a call once ``close()`` began is a ``PublisherClosedError``.
* A copy in a forked child (``os.register_at_fork``): the loop thread, locks, connections and
  background work are the parent's. The child never touches them (not even to close them:
  closing a copy of the parent's event loop would unregister the parent's descriptors from the
  epoll set both share); every call there is a ``PublisherClosedError`` that says to make a new
  publisher, and ``close()`` lets go quietly.
* A blocking (sync) call (not a pin or lease: those never wait) is refused with ``BlockingCallError`` where it would deadlock or stall:
  on a loop that runs this publisher's async work (its own loop thread, or a loop an ``a``-method
  ran on, whose background retirement it would wait for), on a loop an engine needs
  (:meth:`Engine.home_loop`, an AsyncLLM's), or from inside this publisher's own call (an engine
  or a callback it runs, seen through a context variable that follows the call into threads).
  The refusal does not depend on timing: the same program is refused every time.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from lorasync.errors import BlockingCallError, PublisherClosedError

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["CALLER_THREAD", "Closing", "Lifecycle", "async_entry", "blocking"]

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

#: The publishers (by ``id`` of their lifecycle) whose call is running in this context.
_INSIDE: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("lorasync_inside", default=frozenset())

_LIVE: weakref.WeakSet[Lifecycle] = weakref.WeakSet()

#: The thread blocked in the sync call whose coroutine runs in this context (set by
#: :func:`blocking`); None for an ``a``-method awaited on the caller's own loop. The torn-read
#: watch does not count a step of that thread as running: it cannot go on while the call waits
#: (a publish from an optimizer's step hook or closure).
CALLER_THREAD: contextvars.ContextVar[int | None] = contextvars.ContextVar("lorasync_caller_thread", default=None)


class Lifecycle:
    """One publisher's state and guard.

    Args:
        own_loops: the loops this publisher's work needs now: its loop thread's and every
            engine's :meth:`~lorasync.engines.Engine.home_loop` (None entries are ignored).
        on_fork: called in a forked child, to let go of the parent's loop thread and work.
    """

    def __init__(self, *, own_loops: Callable[[], Iterable[asyncio.AbstractEventLoop | None]], on_fork: Callable[[], None]) -> None:
        self.pid = os.getpid()
        self._state = "open"
        self._mutex = threading.Lock()
        self._own_loops = own_loops
        self._on_fork = on_fork
        self._used: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
        _LIVE.add(self)

    # -- state ------------------------------------------------------------------------------------

    @property
    def forked(self) -> bool:
        """This is a forked child's copy of a publisher its parent made."""
        return self.pid != os.getpid()

    @property
    def open(self) -> bool:
        return self._state == "open" and not self.forked

    def closed_error(self, call: str = "this call") -> PublisherClosedError:
        if self.forked:
            return PublisherClosedError(
                f"{call}: this Publisher was made by process {self.pid}, and this is a forked child "
                f"(pid {os.getpid()}): its loop thread, locks and connections belong to the parent. "
                "Make a new Publisher in the child (a DataLoader worker: in worker_init_fn); the "
                "parent's keeps working."
            )
        return PublisherClosedError(f"{call}: the publisher was closed; make a new Publisher to publish again")

    def check_open(self, call: str) -> None:
        """Raises: PublisherClosedError (closed, closing, or forked)."""
        if not self.open:
            raise self.closed_error(call)

    def begin_close(self) -> bool:
        """Start closing; False when it was closed (or is closing) already."""
        with self._mutex:
            if self._state != "open":
                return False
            self._state = "closing"
            return True

    def closed(self) -> None:
        self._state = "closed"

    def let_go_in_child(self) -> None:
        """``close()`` in a forked child: nothing of the parent's is touched, nothing raised."""
        self._state = "closed"

    def _after_fork(self) -> None:
        self._mutex = threading.Lock()  # another parent thread may have held it at the fork
        self._on_fork()

    # -- the guard ----------------------------------------------------------------------------------

    def check_sync(self, call: str, twin: str, *, must_be_open: bool = True) -> None:
        """Refuse a blocking call where it would deadlock or stall (see the module docstring).

        Args:
            call (`str`): what was called, e.g. ``"pin()"``.
            twin (`str`): what to do instead, e.g. ``"await pub.apin(version)"``.
            must_be_open (`bool`): also refuse it once the publisher is closed.

        Raises:
            PublisherClosedError: closed (with ``must_be_open``), or a forked child's copy.
            BlockingCallError: here it would deadlock or stall.
        """
        if self.forked or (must_be_open and self._state != "open"):
            raise self.closed_error(call)
        if id(self) in _INSIDE.get():
            raise BlockingCallError(
                f"{call} was called from inside this publisher's own call (an engine or a callback it "
                f"runs); it would wait for that call, which waits for it: a deadlock. Call it after "
                f"the publisher's call returned (in async code: {twin})."
            )
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return
        if running in self._used or any(loop is running for loop in self._own_loops() if loop is not None):
            raise BlockingCallError(
                f"{call} blocks, and this thread runs an event loop the publisher needs (it runs the "
                f"publisher's async work, or an engine's calls): blocking it would deadlock or stall. "
                f"In async code use `{twin}`."
            )

    @contextlib.contextmanager
    def inside(self, call: str) -> Iterator[None]:
        """An async call of the publisher runs on the current loop.

        Raises:
            PublisherClosedError: closed or forked. BlockingCallError: re-entered from its own call.
        """
        if id(self) in _INSIDE.get():
            raise BlockingCallError(
                f"await {call} from inside this publisher's own call (an engine or a callback it runs) "
                "would wait for that call, which waits for it: a deadlock. Call it after the call returned."
            )
        self.check_open(call)
        self._used.add(asyncio.get_running_loop())
        token = _INSIDE.set(_INSIDE.get() | {id(self)})
        try:
            yield
        finally:
            _INSIDE.reset(token)


def async_entry(call: str) -> Callable[[F], F]:
    """Decorate a publisher's async method: it runs :meth:`Lifecycle.inside` (``self._life``)."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        async def entry(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self._life.inside(call):
                return await method(self, *args, **kwargs)

        return entry  # type: ignore[return-value]

    return wrap


class Closing:
    """``with`` and ``async with`` for an object with ``close()`` and ``aclose()`` (publishers,
    fleets, engines): the block's end closes it, however the block ends."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # type: ignore[attr-defined]

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()  # type: ignore[attr-defined]


def blocking(instead: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The sync face of a public async method, written once: decorate a stub named ``name``
    (its signature and docstring are the public ones; its body is never run) and the call runs
    ``a<name>`` with the same arguments on the object's loop (``self._loop``), after the one guard
    (:meth:`Lifecycle.check_sync`, ``self._life``) that refuses it where it would deadlock.

    Args:
        instead: what to write in async code, for the refusal, e.g.
            ``"await fleet.apublish(adapters, versions=...)"``.

    tests/test_architecture.py checks that every sync face takes exactly its twin's parameters.
    """

    def wrap(stub: Callable[..., Any]) -> Callable[..., Any]:
        name = stub.__name__
        twin, call = f"a{name}", f"{name}()"

        @functools.wraps(stub)
        def face(self: Any, *args: Any, **kwargs: Any) -> Any:
            self._life.check_sync(call, instead)
            return self._loop.run(_called_from(threading.get_ident(), getattr(self, twin)(*args, **kwargs)))

        face.__lorasync_twin__ = twin  # type: ignore[attr-defined]
        return face

    return wrap


async def _called_from(thread: int, call: Awaitable[Any]) -> Any:
    CALLER_THREAD.set(thread)  # this task's own context, and everything it starts
    return await call


def _after_fork_in_child() -> None:
    for life in list(_LIVE):
        life._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
