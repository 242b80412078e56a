"""One rank's error raised on every rank: :func:`agree_on_error`.

A publish that fails on the rank that talks to the engines must stop every rank of the job, not
only that one: the others would otherwise go on into the next collective (the next publish, or
the trainer's own gradient all-reduce) and wait there for a rank that left. The failing rank
broadcasts its error as JSON (class name, message, plain context: :mod:`._wire`, no pickle) and
every rank rebuilds the same :mod:`lorasync.errors` class, so they all raise at the same point.
"""

from __future__ import annotations

from typing import Any

import torch

from lorasync.runtime._collectives import collective_device, decode_json, encode_json
from lorasync.distributed._wire import decode_error, encode_error
from lorasync.errors import LoraSyncError, TransportError

__all__ = ["agree_on_error"]


def agree_on_error(error: LoraSyncError | None, *, src: int, group: Any = None) -> LoraSyncError | None:
    """``src``'s error (or None) on every rank of ``group`` (collective: every rank calls it).

    Args:
        error: on ``src``, the error every rank must raise, or None when all went well; ignored
            on other ranks.
        src (`int`): global rank whose error counts.
        group (`ProcessGroup`, *optional*): the ranks that agree (default: the whole job).

    Returns:
        On ``src``, ``error`` itself; elsewhere an error of the same ``lorasync.errors`` class with
        the same message and plain context (plus ``rank=src``), or None.

    Raises:
        TransportError: the broadcast failed (a rank died, or the group's timeout passed).
    """
    import torch.distributed as dist

    device = collective_device(dist, group)
    is_src = int(dist.get_rank()) == src
    message = encode_json(encode_error(error) if is_src and error is not None else None, device=device)
    try:
        # Length first, so every rank allocates the same buffer; ~20 bytes when all went well.
        size = torch.tensor([message.numel()], dtype=torch.int64, device=device)
        dist.broadcast(size, src=src, group=group)
        if not is_src:
            message = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.broadcast(message, src=src, group=group)
    except RuntimeError as exc:
        raise TransportError(
            f"a torch.distributed broadcast failed while rank {src} told the others whether its publish failed: {exc}; "
            "every rank must publish at the same steps (the same every= and max_steps) and the group's timeout must "
            "exceed one publish"
        ) from exc
    if is_src:
        return error
    data = decode_json(message)
    return None if data is None else decode_error(data, rank=src)
