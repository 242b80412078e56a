"""The transport protocol: how an Adapter's bytes reach one engine.

A transport says whether it can serve an engine (``unsupported``), delivers one version
(``deliver``) and retires an old one (``retire``). Transports are async because the publisher
drives many engines at once; they hold no per-publish state beyond what they document.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from lorasync.adapter._adapter import Adapter
    from lorasync.engines._engine import Capabilities, Engine

__all__ = ["Delivery", "Transport"]


@dataclass
class Delivery:
    """What one delivery did."""

    served_name: str
    bytes_moved: int
    timings: dict[str, float] = field(default_factory=dict)


class Transport:
    """What every transport subclasses: ``name``, ``unsupported``, ``deliver``, ``retire``."""

    name: ClassVar[str] = ""
    versioned: ClassVar[bool] = True  # serves ``name@vN`` names that retention unloads

    def unsupported(self, caps: Capabilities) -> str | None:
        """Why this transport cannot serve an engine with ``caps``; None if it can."""
        raise NotImplementedError

    async def deliver(self, adapter: Adapter, engine: Engine, caps: Capabilities, *, name: str, version: int, served: str) -> Delivery:
        """Make ``engine`` serve ``adapter`` as ``served``; return only once it does.

        On failure the engine keeps serving what it served before, and the error is a
        ``LoraSyncError``.
        """
        raise NotImplementedError

    async def retire(self, engine: Engine, *, name: str, version: int, served: str) -> None:
        """Stop ``engine`` serving an old version (files are the publisher's business)."""
        await engine.aunload_adapter(served)
