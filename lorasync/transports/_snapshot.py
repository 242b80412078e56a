"""Owned copies: what lorasync keeps in order to put a version back is its own (design invariant 7).

An Adapter from a no-copy export wraps the trainer's tensors, which the next optimizer step
changes in place. The merged transport's roll-back and the in-place restore after a failed
verification must push the *previous* version's bytes, so they keep an :class:`OwnedAdapter`: a
copy nobody else holds, taken once per publish, on the tensors' own device (a fold on the GPU
stays there). Only those paths copy; disk and ipc publishes stay zero-copy (the disk transport's
roll-back point is the version's immutable files).
"""

from __future__ import annotations

from lorasync._adapter import Adapter

__all__ = ["OwnedAdapter", "owned_copy"]


class OwnedAdapter(Adapter):
    """An :class:`~lorasync.Adapter` over tensors that only lorasync holds (never written after
    it was made)."""

    __slots__ = ()


def owned_copy(adapter: Adapter) -> OwnedAdapter:
    """``adapter`` over fresh copies of its tensors (itself when it is an owned copy already)."""
    if isinstance(adapter, OwnedAdapter):
        return adapter
    return OwnedAdapter({key: tensor.detach().clone() for key, tensor in adapter.tensors.items()}, adapter.config)
