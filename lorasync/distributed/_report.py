"""What a distributed publish reports: one :class:`NodeResult` per node, gathered into a
:class:`DistributedPublishReport` on ``src`` (and their JSON form on the wire)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lorasync.publisher._report import EngineResult, PublishReport
from lorasync.distributed._wire import decode_error, decode_result, encode_error, encode_result
from lorasync.errors import LoraSyncError

__all__ = ["DistributedPublishReport", "NodeResult", "decode_node", "encode_node"]


@dataclass
class NodeResult:
    """What one node's leader did in a distributed publish.

    ``bytes_received`` counts payload bytes that reached the node over the process group (0 on
    ``src``'s own node). ``error`` is set when the leader failed before reaching its engines
    (then every engine of the node is reported failed with it).
    """

    node: str
    rank: int
    results: list[EngineResult] = field(default_factory=list)
    bytes_received: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    error: LoraSyncError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.results) and all(r.ok for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "rank": self.rank,
            "ok": self.ok,
            "bytes_received": self.bytes_received,
            "timings": dict(self.timings),
            "error": None if self.error is None else {"type": type(self.error).__name__, "message": str(self.error)},
            "results": [r.to_dict() for r in self.results],
        }


@dataclass
class DistributedPublishReport(PublishReport):
    """A :class:`~lorasync.PublishReport` over every node's engines.

    ``results`` lists every engine of every node (their ``url`` prefixed with ``[node]``, since
    each node may run an engine at the same loopback address); ``nodes`` groups them by node.
    ``payload_bytes`` is the serialised adapter (safetensors header + tensor data) and
    ``bytes_sent`` what ``src`` broadcast over the process group: ``payload_bytes`` times the
    number of receiving leaders.
    """

    nodes: list[NodeResult] = field(default_factory=list)
    payload_bytes: int = 0
    bytes_sent: int = 0

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data.update(payload_bytes=self.payload_bytes, bytes_sent=self.bytes_sent, nodes=[n.to_dict() for n in self.nodes])
        return data

    def __str__(self) -> str:
        lines = [super().__str__(), f"  sent {self.bytes_sent} B over torch.distributed ({self.payload_bytes} B payload)"]
        for n in self.nodes:
            state = "ok" if n.ok else f"FAILED: {n.error}" if n.error else f"{sum(not r.ok for r in n.results)} engine(s) failed"
            lines.append(f"  node {n.node} (leader rank {n.rank}): {len(n.results)} engine(s), received {n.bytes_received} B, {state}")
        return "\n".join(lines)


def encode_node(node: NodeResult) -> dict[str, Any]:
    return {
        "node": node.node,
        "rank": node.rank,
        "bytes_received": node.bytes_received,
        "timings": node.timings,
        "error": None if node.error is None else encode_error(node.error),
        "results": [encode_result(r) for r in node.results],
    }


def decode_node(data: Mapping[str, Any]) -> NodeResult:
    node, rank = str(data["node"]), int(data["rank"])
    return NodeResult(
        node=node,
        rank=rank,
        results=[decode_result(r, node=node, leader_rank=rank) for r in data["results"]],
        bytes_received=int(data["bytes_received"]),
        timings={str(k): float(v) for k, v in dict(data["timings"]).items()},
        error=None if data["error"] is None else decode_error(data["error"], node=node, leader_rank=rank),
    )
