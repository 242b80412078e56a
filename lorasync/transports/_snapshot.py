"""Owned copies: what lorasync keeps in order to put a version back is its own (design invariant 7).

An Adapter from a no-copy export wraps the trainer's tensors, which the next optimizer step
changes in place. The merged transport's roll-back and the in-place restore after a failed
verification must push the *previous* version's bytes, so they keep an :class:`OwnedAdapter`: a
copy nobody else holds, taken once per publish, on the tensors' own device (a fold on the GPU
stays there). Only those paths copy; disk and ipc publishes stay zero-copy (the disk transport's
roll-back point is the version's immutable files), except to an engine in this process that
keeps the tensors it is handed (:func:`kept_by`): it serves them, so it gets an owned copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lorasync.adapter._adapter import Adapter
from lorasync.engines._engine import is_in_process_id

if TYPE_CHECKING:
    from lorasync.engines._engine import Engine

__all__ = ["OwnedAdapter", "kept_by", "owned_copy"]


class OwnedAdapter(Adapter):
    """An :class:`~lorasync.Adapter` over tensors that only lorasync holds (never written after
    it was made)."""

    __slots__ = ()


def owned_copy(adapter: Adapter) -> OwnedAdapter:
    """``adapter`` over fresh copies of its tensors (itself when it is an owned copy already)."""
    if isinstance(adapter, OwnedAdapter):
        return adapter
    return OwnedAdapter({key: tensor.detach().clone() for key, tensor in adapter.tensors.items()}, adapter.config)


def kept_by(engine: Engine) -> bool:
    """Whether ``engine`` keeps the very tensors a tensor load hands it: it lives in this process
    and does not say it copies them (``Engine.copies_tensors``). Such an engine must be handed
    an owned copy, or the trainer's next optimizer step changes what it serves (invariant 7).
    Duck-typed engines without the attributes count as keeping them."""
    if getattr(engine, "copies_tensors", False) is True:
        return False
    instance_id = getattr(engine, "instance_id", None)
    return not isinstance(instance_id, str) or is_in_process_id(instance_id)
