"""torch.distributed helpers every collective protocol of lorasync shares.

JSON messages travel as ``uint8`` tensors (never pickle) on the group's device: CUDA for NCCL,
CPU for gloo. Used by :mod:`lorasync.distributed` (the multi-node publish) and the Megatron
exporter (metadata exchange); it sits on a low floor so exporters may import it.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from lorasync.errors import TransportError

__all__ = ["all_gather_json", "collective_device", "decode_json", "encode_json", "gather_json"]


def collective_device(dist: Any, group: Any = None) -> torch.device:
    """The device buffers of ``group`` (None: the default group) must live on."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def encode_json(obj: Any, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """``obj`` as UTF-8 JSON in a 1-D ``uint8`` tensor."""
    raw = json.dumps(obj, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device) if raw else torch.empty(0, dtype=torch.uint8, device=device)


def decode_json(buffer: torch.Tensor) -> Any:
    """Inverse of :func:`encode_json` (the tensor may live on any device).

    Raises:
        TransportError: not UTF-8 JSON.
    """
    raw = buffer.detach().to("cpu").numpy().tobytes()
    try:
        return json.loads(raw.decode())
    except ValueError as exc:
        raise TransportError(f"a message received over torch.distributed is not JSON: {exc}") from exc


def _padded(dist: Any, obj: Any, group: Any, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This rank's message padded to the longest one of ``group``, and every rank's length."""
    size = int(dist.get_world_size(group))
    payload = encode_json(obj, device=device)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(size)]
    dist.all_gather(lengths, length, group=group)  # every member must pad to the same size
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    return padded, lengths


def all_gather_json(dist: Any, obj: Any, group: Any, device: torch.device) -> list[Any]:
    """Every rank's ``obj`` on every rank, in group-rank order (lengths first, then bytes).

    Args:
        dist: ``torch.distributed``.
        obj: JSON-serialisable.
        group: the process group (None: the default group).
        device: :func:`collective_device` of ``group``.

    Returns:
        `list`: one decoded object per rank of ``group``.
    """
    if int(dist.get_world_size(group)) == 1:
        return [obj]
    padded, lengths = _padded(dist, obj, group, device)
    buffers = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(buffers, padded, group=group)
    return [decode_json(b[: int(n.item())]) for b, n in zip(buffers, lengths)]


def gather_json(dist: Any, obj: Any, dst: int, group: Any, device: torch.device) -> list[Any] | None:
    """Every member's ``obj`` on global rank ``dst`` (None elsewhere), in group-rank order."""
    padded, lengths = _padded(dist, obj, group, device)
    is_dst = int(dist.get_rank()) == dst
    buffers = [torch.empty_like(padded) for _ in lengths] if is_dst else None
    dist.gather(padded, buffers, dst=dst, group=group)
    if not is_dst:
        return None
    assert buffers is not None
    return [decode_json(b[: int(n.item())]) for b, n in zip(buffers, lengths)]
