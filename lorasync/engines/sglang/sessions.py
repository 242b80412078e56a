"""One weight-update session at a time per SGLang server, as SGLang allows.

SGLang 0.5.23 and main keep one ``/begin_weight_update`` ... ``/end_weight_update`` session per
server: a second ``begin`` is refused ("a weight-update session is already open"). lorasync opens
sessions for streamed adapter loads (SGLang main) and merged weight updates, and callers run
those concurrently (a Fleet loads every changed tenant at once; several publishers may share a
server). :class:`SessionGate` serialises them inside this process: one gate per server, shared
by every client of it however its URL is spelled (``127.0.0.1``, ``localhost``, a trailing
slash: :func:`~lorasync.engines._hosts.server_key`), whichever thread or event loop drives it.

Within one event loop the waiters queue on an ``asyncio.Lock`` (first come, first served, no
polling); across threads and loops one ``threading.Lock`` decides, polled without blocking the
loop. A session of another process is not seen here: SGLang's refusal then says so.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import ClassVar

from lorasync.engines._hosts import server_key

__all__ = ["SessionGate"]


class SessionGate:
    """The right to hold a weight-update session on one SGLang server (see the module docstring).

    Use :meth:`for_url` to get the gate of a server; :meth:`acquire`/:meth:`release` from a
    coroutine, :meth:`acquire_sync`/:meth:`release` from a thread that runs no event loop.
    """

    _gates: ClassVar[dict[object, SessionGate]] = {}
    _gates_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, url: str) -> None:
        self.url = url
        self._lock = threading.Lock()
        # One asyncio queue per event loop (an asyncio.Lock belongs to the loop that uses it).
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()
        self._owner: asyncio.Lock | None = None  # the loop queue whose holder holds ``_lock``

    @classmethod
    def for_url(cls, url: str) -> SessionGate:
        """The process-wide gate of the server at ``url``.

        Args:
            url (`str`): the server's URL, in any spelling.

        Returns:
            `SessionGate`: the one gate of that server in this process.
        """
        # Keyed by the server, not the string: two spellings of one server are one session.
        key = server_key(url) or url.rstrip("/")
        with cls._gates_lock:
            gate = cls._gates.get(key)
            if gate is None:
                gate = cls._gates[key] = cls(url.rstrip("/"))
            return gate

    def __reduce__(self) -> tuple[object, tuple[str]]:
        # A pickled client (a Ray actor, a spawned worker) takes its process's gate of the URL.
        return (SessionGate.for_url, (self.url,))

    async def acquire(self) -> None:
        """Wait (without blocking the loop) until no other session of this process is open here.

        Cancellation while waiting leaves the gate as it was.
        """
        loop = asyncio.get_running_loop()
        with self._gates_lock:
            queue = self._queues.get(loop)
            if queue is None:
                queue = self._queues[loop] = asyncio.Lock()
        await queue.acquire()
        try:
            delay = 0.001
            while not self._lock.acquire(blocking=False):  # held by another thread or loop
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.02)
        except BaseException:
            queue.release()
            raise
        self._owner = queue

    def acquire_sync(self) -> None:
        """Block until no other session of this process is open here (call from no event loop)."""
        self._lock.acquire()
        self._owner = None

    def release(self) -> None:
        """Give the gate to the next waiter (on the loop that acquired it, for async holders)."""
        owner, self._owner = self._owner, None
        self._lock.release()
        if owner is not None:
            owner.release()
