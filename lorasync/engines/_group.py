"""One URL, several engines: the extension point for deployments where the URL a trainer knows
is not one engine (a router in front of N servers, a serving stack's gateway).

A load sent to such a URL reaches one replica; the others then answer 404 for the new version,
or serve an old one. An ``EngineGroup`` says which engines stand behind its URL, and every
publisher surface (``Publisher``, ``Fleet``, ``publish_adapter``, the CLI, the distributed
publisher) takes each of them as an engine of its own (``lorasync.engines._registry.engine_list``):
each replica gets the load, the verification, retention, leases, in-flight drain and recovery
that one engine gets, and the report has a result per replica.

The members are listed once, when the publisher (or fleet) is made: a replica added later is
not published to by that publisher, one that went away fails as an unreachable engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from lorasync.runtime._lifecycle import Closing

if TYPE_CHECKING:
    from lorasync.engines._engine import Engine

__all__ = ["EngineGroup"]


class EngineGroup(Closing):
    """What a group of engines behind one URL subclasses: set ``kind`` and implement
    :meth:`members`. Registered like an engine (``connect(kind, url)``, ``"kind:url"`` specs,
    the ``lorasync.engines`` entry points)."""

    kind: ClassVar[str] = ""
    url: str = ""

    def members(self) -> list[Engine]:
        """The engines behind :attr:`url` now, as clients of their own (the caller closes them).

        Raises:
            EngineError: the group could not say (unreachable, not such a group, no members);
                its message names what to do.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Let go of what the group holds itself (not its members' clients)."""

    async def aclose(self) -> None:
        """Async twin of :meth:`close`."""
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r})"
