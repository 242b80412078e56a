"""What a :class:`~lorasync.distributed.DistributedFleet` round reports: every node's
:class:`~lorasync.TenantReport` of every tenant, gathered on ``src`` (and their JSON form on the wire)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lorasync.fleet._plan import FleetReport, TenantReport
from lorasync.publisher._report import PublishReport
from lorasync.distributed._wire import decode_error, decode_result, encode_error, encode_result

__all__ = ["DistributedFleetReport", "decode_tenants", "encode_tenants"]


@dataclass
class DistributedFleetReport:
    """One round of a :class:`~lorasync.distributed.DistributedFleet`, on ``src``.

    Attributes:
        tenants (`dict[str, dict[str, TenantReport]]`): by tenant, then by node: what each node's
            leader did for it (``loaded``, ``unchanged``, ``restored`` or ``failed``). Engine
            URLs in the results are prefixed with ``[node]``.
        sent (`list[str]`): the tenants whose adapter crossed the process group (content changed).
        bytes_sent (`int`): what ``src`` broadcast to the leaders (payload bytes times receivers).
    """

    tenants: dict[str, dict[str, TenantReport]] = field(default_factory=dict)
    sent: list[str] = field(default_factory=list)
    bytes_sent: int = 0

    def __getitem__(self, name: str) -> dict[str, TenantReport]:
        return self.tenants[name]

    @property
    def ok(self) -> bool:
        return all(t.ok for nodes in self.tenants.values() for t in nodes.values())

    def versions(self, name: str) -> set[int | None]:
        """The versions ``name`` serves across nodes after the round (one, unless a node failed)."""
        return {t.version for t in self.tenants[name].values()}

    def raise_for_errors(self) -> None:
        """Raise the first failure (typed; its context names the node).

        Raises:
            LoraSyncError: the first failed tenant's error.
        """
        for nodes in self.tenants.values():
            for report in nodes.values():
                if report.error is not None:
                    raise report.error


def encode_tenants(report: FleetReport) -> dict[str, Any]:
    """A node's :class:`FleetReport` as JSON-safe data."""
    return {
        name: {
            "registration": t.registration, "status": t.status, "version": t.version, "served_name": t.served_name,
            "restored_on": list(t.restored_on), "error": None if t.error is None else encode_error(t.error),
            "results": [encode_result(r) for r in t.results],
        }
        for name, t in report.tenants.items()
    }  # fmt: skip


def decode_tenants(data: Mapping[str, Any], *, node: str, rank: int) -> dict[str, TenantReport]:
    """Inverse of :func:`encode_tenants`; engine URLs are prefixed with ``[node]``."""
    out = {}
    for name, t in data.items():
        results = [decode_result(r, node=node, leader_rank=rank) for r in t["results"]]
        for r in results:
            r.url = f"[{node}] {r.url}"
        publish = PublishReport(name=name, version=t["version"] or 0, served_name=t["served_name"], content_hash="", nbytes=0, results=results) if results else None
        error = None if t["error"] is None else decode_error(t["error"], node=node, leader_rank=rank)
        restored_on = [f"[{node}] {w}" for w in t["restored_on"]]
        out[name] = TenantReport(name, t["registration"], t["status"], t["version"], t["served_name"], publish=publish, error=error, restored_on=restored_on)
    return out
