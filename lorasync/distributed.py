"""Multi-node publish over torch.distributed: engines on other hosts, no shared filesystem.

A trainer's engines may run on hosts whose disks it cannot write. :class:`DistributedPublisher`
uses the process group the trainer already runs: the exporting rank (``src``) serialises the
adapter once, one rank per node (the node *leader*) receives it, writes it under a node-local
root and publishes it to that node's engines with an ordinary :class:`~lorasync.Publisher`. Every
leader's results come back to ``src`` as one :class:`DistributedPublishReport`.

Protocol of one :meth:`DistributedPublisher.publish` (every rank of ``group`` calls it):

1. ``src`` serialises the adapter (safetensors layout, config and content hash as JSON metadata;
   no pickle) and broadcasts a small int64 header over ``group``: status, version, payload size.
   A refusal on ``src`` (no adapter, bad version, bad tensors) follows as JSON and is raised as the
   same error on every rank, so no rank waits for bytes that never come.
2. Ranks that are neither ``src`` nor a leader with engines return None.
3. ``src`` broadcasts the payload within the leaders' group (made once, at construction): the
   adapter crosses the network once per receiving node, whatever the number of ranks.
4. Each leader decodes the payload (bounds and content hash checked), publishes locally and
   encodes its results as JSON. Any failure there becomes failed results for that node's engines,
   never an exception, so the protocol always completes and other nodes are not held up.
5. Results are gathered to ``src`` (lengths first, then padded ``uint8`` buffers).

With NCCL every buffer lives on the current CUDA device; with gloo on the CPU.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from lorasync._adapter import Adapter
from lorasync._distributed_wire import (
    decode_adapter,
    decode_error,
    decode_json,
    decode_result,
    encode_adapter,
    encode_error,
    encode_json,
    encode_result,
)
from lorasync._names import served_name, validate_name, validate_version
from lorasync._probe import Probe
from lorasync._publish import Publisher
from lorasync._report import EngineResult, PublishReport
from lorasync.engines._base import Engine
from lorasync.errors import ConfigError, LoraSyncError, PublishError, TransportError

__all__ = ["DistributedPublishReport", "DistributedPublisher", "NodeResult", "decode_adapter", "encode_adapter"]

TRANSPORTS = ("auto", "disk", "ipc")
_OK, _REFUSED = 0, 1


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


class DistributedPublisher:
    """Publish from one rank to engines on every node, over torch.distributed.

    Construction and :meth:`publish` are collective: every rank of ``group`` calls them, with
    the same ``name`` and ``src``. Construction also creates the leaders' process group with
    ``torch.distributed.new_group``; with the default ``group`` (the whole job) every rank of the
    job takes part, as torch requires.

    Args:
        group (`ProcessGroup`, *optional*): the ranks that publish together (default: the whole
            job). Its backend decides the device of every buffer: CUDA for NCCL, CPU for gloo.
        name (`str`): the adapter's name; engines serve version N as ``name@vN``.
        engines: this rank's node-local engines (clients or specs such as
            ``"vllm:http://127.0.0.1:8000"``); only a node's leader may hold engines. A leader
            without engines receives nothing.
        node_id (`str | int`, *optional*): this rank's node. Default: ``$GROUP_RANK`` (torchrun's
            node rank), else ``global rank // $LOCAL_WORLD_SIZE``, else the host name.
        is_leader (`bool`, *optional*): whether this rank leads its node. Default:
            ``$LOCAL_RANK == 0`` when set, else the node's lowest rank.
        root (`str | os.PathLike`, *optional*): node-local disk root of this leader's versions
            (default ``/dev/shm/lorasync``, tmpfs).
        keep (`int`): versions each engine keeps loaded.
        transport (`str`): ``"auto"``, ``"disk"`` or ``"ipc"`` for this leader's engines.
        src (`int`): global rank that holds the adapter and receives the report.
        verify (`Probe`, *optional*): default probe, sent along with the adapter and checked
            through every engine after loading.
        timeout (`datetime.timedelta`, *optional*): timeout of the leaders' group; it must exceed
            the slowest node's local publish (engine retries included). Default: torch's.

    Raises:
        ConfigError: torch.distributed is not initialised, or the ranks' configuration does not fit
            (no or several leaders on a node, engines on a non-leader, different names or ``src``,
            no engines anywhere). Raised on every rank.
        InvalidNameError: a bad ``name``, on every rank.

    Example:
        >>> pub = DistributedPublisher(  # doctest: +SKIP
        ...     name="policy", engines=["vllm:http://127.0.0.1:8000"] if local_rank == 0 else []
        ... )
        >>> report = pub.publish(adapter if rank == 0 else None, version=step)  # doctest: +SKIP
    """

    def __init__(
        self,
        group: Any = None,
        *,
        name: str,
        engines: Iterable[Engine | str] | Engine | str = (),
        node_id: str | int | None = None,
        is_leader: bool | None = None,
        root: str | os.PathLike[str] | None = None,
        keep: int = 2,
        transport: str = "auto",
        src: int = 0,
        verify: Probe | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("DistributedPublisher needs an initialised torch.distributed process group (init_process_group)")
        self.group = group
        self.src = src
        self.verify = verify
        self.rank = int(dist.get_rank())
        self._device = _device(dist, group)
        if isinstance(engines, (Engine, str)):
            engines = [engines]
        engines = list(engines)
        self.node_id = str(node_id) if node_id is not None else _default_node(self.rank)
        self._local: Publisher | None = None
        problem: dict[str, Any] | None = None
        try:  # a local mistake must reach every rank, or the others would wait for this one
            self.name = validate_name(name)
            if transport not in TRANSPORTS:
                raise ConfigError(
                    f"transport must be one of {TRANSPORTS} for node-local engines, got {transport!r} "
                    "(the merged fallback needs base weights on every node and is not distributed)"
                )
            if engines:
                self._local = Publisher(engines, name=name, transport=transport, keep=keep, root=root)
        except LoraSyncError as exc:
            problem = encode_error(exc)
        role = {
            "rank": self.rank,
            "node": self.node_id,
            "leader": _default_leader() if is_leader is None else bool(is_leader),
            "engines": len(engines),
            "name": name if isinstance(name, str) else repr(name),
            "src": src,
            "problem": problem,
        }
        try:
            everyone = _all_gather_json(dist, role, group, self._device)
        except RuntimeError as exc:
            raise _collective_error("construction", exc) from exc
        self.leaders, members = _resolve(everyone, src)
        self.is_leader = self.leaders.get(self.node_id) == self.rank
        self.members = members
        self._sub: Any = None
        if len(members) > 1:
            try:
                if group is None or group is dist.group.WORLD:
                    sub = dist.new_group(members, timeout=timeout)  # every rank of the job calls
                elif self.rank in members:
                    sub = dist.new_group(members, timeout=timeout, use_local_synchronization=True)
                else:
                    sub = None
            except RuntimeError as exc:
                raise _collective_error("creating the leaders' group", exc) from exc
            self._sub = sub if self.rank in members else None

    # -- public ---------------------------------------------------------------------------------

    def publish(
        self,
        adapter: Adapter | nn.Module | Mapping[str, torch.Tensor] | None = None,
        *,
        version: int | None = None,
        verify: Probe | None = None,
    ) -> DistributedPublishReport | None:
        """Publish ``adapter`` (held by ``src``) as ``version`` on every node (collective).

        Args:
            adapter: on ``src``, an :class:`~lorasync.Adapter` (or a PEFT model / state dict,
                exported first); ignored on other ranks (pass None).
            version (`int`): required on ``src``; other ranks may pass None or the same value.
            verify (`Probe`, *optional*): on ``src``, overrides the default probe; it travels
                with the adapter and every engine is checked against it.

        Returns:
            `DistributedPublishReport` on ``src``; None on every other rank. Engine failures are
            reported, not raised (``report.raise_for_errors()`` raises them).

        Raises:
            InvalidNameError, ConfigError, AdapterError, ExportError: ``src``'s adapter or version
                was refused (nothing was sent); raised on every rank.
            ConfigError: this rank passed a version other than ``src``'s (raised once the
                collective has completed; a leader reports its engines failed with it).
            TransportError: a collective failed (a rank died or the timeout is too short).
        """
        import torch.distributed as dist

        start = time.perf_counter()
        timings: dict[str, float] = {}
        is_src = self.rank == self.src
        payload: torch.Tensor | None = None
        refusal: LoraSyncError | None = None
        if is_src:
            try:
                if adapter is None:
                    raise ConfigError(f"rank {self.src} is src= of the distributed publish but passed no adapter")
                version = validate_version(version)
                if not isinstance(adapter, Adapter):
                    from lorasync.exporters.fsdp import export

                    adapter = export(adapter)
                payload = encode_adapter(adapter, probe=verify or self.verify, device=self._device)
            except LoraSyncError as exc:
                refusal = exc
            except Exception as exc:  # an untranslated failure must still reach every rank
                refusal = PublishError(f"rank {self.src} could not serialise the adapter: {type(exc).__name__}: {exc}")
                refusal.__cause__ = exc
            timings["serialize"] = time.perf_counter() - start
        try:
            header = torch.tensor(
                [_REFUSED if refusal else _OK, version if is_src and refusal is None else 0, 0 if payload is None else payload.numel()],
                dtype=torch.int64,
                device=self._device,
            )
            dist.broadcast(header, src=self.src, group=self.group)
            status, sent_version, nbytes = (int(x) for x in header.tolist())
            if status == _REFUSED:
                message = encode_json(encode_error(refusal) if refusal else None, device=self._device)
                size = torch.tensor([message.numel()], dtype=torch.int64, device=self._device)
                dist.broadcast(size, src=self.src, group=self.group)
                if not is_src:
                    message = torch.empty(int(size.item()), dtype=torch.uint8, device=self._device)
                dist.broadcast(message, src=self.src, group=self.group)
                if refusal is not None:
                    raise refusal
                raise decode_error(decode_json(message), rank=self.src)
        except RuntimeError as exc:
            raise _collective_error("the header broadcast", exc) from exc
        mismatch = None if is_src else _version_mismatch(version, sent_version, self.rank)
        if self._sub is None and not is_src and self._local is None:
            if mismatch is not None:
                raise mismatch
            return None

        node_results: list[NodeResult] = []
        bytes_sent = 0
        try:
            t0 = time.perf_counter()
            if self._sub is not None:
                buffer = payload if is_src else torch.empty(nbytes, dtype=torch.uint8, device=self._device)
                dist.broadcast(buffer, src=self.src, group=self._sub)
                if is_src:
                    bytes_sent = nbytes * (len(self.members) - 1)
                else:
                    payload = buffer
            timings["broadcast"] = time.perf_counter() - t0
            mine = None
            if self._local is not None:
                source = adapter if is_src else payload
                mine = self._publish_local(source, sent_version, 0 if is_src else nbytes, mismatch, verify or self.verify)
            t0 = time.perf_counter()
            if self._sub is not None:
                gathered = _gather_json(
                    dist, None if mine is None or is_src else _encode_node(mine), self.src, self._sub, self._device
                )
            else:
                gathered = None
            timings["gather"] = time.perf_counter() - t0
        except RuntimeError as exc:
            raise _collective_error("the payload broadcast or the results gather", exc) from exc
        if not is_src:
            if mismatch is not None:
                raise mismatch
            return None
        assert isinstance(adapter, Adapter) and payload is not None
        for item in gathered or []:
            if item is not None:
                node_results.append(_decode_node(item))
        if mine is not None:
            node_results.append(mine)
        node_results.sort(key=lambda n: n.rank)
        results = [replace(r, url=f"[{n.node}] {r.url}") for n in node_results for r in n.results]
        names = {r.served_name for r in results if r.ok and r.served_name}
        timings["total"] = time.perf_counter() - start
        return DistributedPublishReport(
            name=self.name,
            version=sent_version,
            served_name=names.pop() if len(names) == 1 else served_name(self.name, sent_version),
            content_hash=adapter.content_hash,
            nbytes=adapter.nbytes,
            results=results,
            timings=timings,
            nodes=node_results,
            payload_bytes=nbytes,
            bytes_sent=bytes_sent,
        )

    def close(self) -> None:
        """Close this rank's engine clients (the process groups belong to the trainer)."""
        if self._local is not None:
            self._local.close()

    def __enter__(self) -> DistributedPublisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the leader's part ----------------------------------------------------------------------

    def _publish_local(
        self, source: Any, version: int, received: int, mismatch: ConfigError | None, probe: Probe | None
    ) -> NodeResult:
        """Publish ``source`` (src's Adapter, or the received buffer) on this node; every failure
        becomes a result, so the collective completes."""
        assert self._local is not None
        node = NodeResult(node=self.node_id, rank=self.rank, bytes_received=received)
        start = time.perf_counter()
        try:
            if mismatch is not None:
                raise mismatch
            if isinstance(source, Adapter):
                adapter = source
            else:
                adapter, probe = decode_adapter(source)
                node.timings["decode"] = time.perf_counter() - start
            report = self._local.publish(adapter, version=version, verify=probe)
            node.results = list(report.results)
            node.timings.update(report.timings)
        except Exception as exc:  # never leave src waiting: report the node failed instead
            error = exc if isinstance(exc, LoraSyncError) else PublishError(
                f"node {self.node_id} (rank {self.rank}) failed before reaching its engines: {type(exc).__name__}: {exc}"
            )
            if error is not exc:
                error.__cause__ = exc
            node.error = error
            node.results = [
                EngineResult(engine=e.kind or type(e).__name__, url=e.url, status="failed", error=error) for e in self._local.engines
            ]
        node.timings["local"] = time.perf_counter() - start
        return node


# -- roles ---------------------------------------------------------------------------------------


def _default_node(rank: int) -> str:
    env = os.environ
    if env.get("GROUP_RANK", "").isdigit():
        return env["GROUP_RANK"]
    if env.get("LOCAL_WORLD_SIZE", "").isdigit() and int(env["LOCAL_WORLD_SIZE"]) > 0:
        return str(rank // int(env["LOCAL_WORLD_SIZE"]))
    return socket.gethostname()


def _default_leader() -> bool | None:
    local = os.environ.get("LOCAL_RANK", "")
    return int(local) == 0 if local.isdigit() else None


def _resolve(everyone: list[dict[str, Any]], src: int) -> tuple[dict[str, int], list[int]]:
    """Leaders per node and the members of the leaders' group; ConfigError (on every rank, since
    every rank sees the same roles) when the roles do not fit."""
    for role in everyone:
        if role["problem"] is not None:
            raise decode_error(role["problem"], rank=role["rank"])
    names = {role["name"] for role in everyone}
    if len(names) != 1:
        raise ConfigError(f"ranks publish different names {sorted(names)}; pass the same name= on every rank")
    srcs = {role["src"] for role in everyone}
    if len(srcs) != 1:
        raise ConfigError(f"ranks pass different src= values {sorted(srcs)}; pass the same src on every rank")
    ranks = sorted(role["rank"] for role in everyone)
    if src not in ranks:
        raise ConfigError(f"src={src} is not a rank of the publishing group {ranks}")
    nodes: dict[str, list[dict[str, Any]]] = {}
    for role in sorted(everyone, key=lambda r: r["rank"]):
        nodes.setdefault(role["node"], []).append(role)
    leaders: dict[str, int] = {}
    for node, roles in nodes.items():
        chosen = [r["rank"] for r in roles if r["leader"] is True]
        if not chosen:
            undecided = [r["rank"] for r in roles if r["leader"] is None]
            if not undecided:
                raise ConfigError(
                    f"node {node!r} (ranks {[r['rank'] for r in roles]}) has no leader: pass is_leader=True on one "
                    "of its ranks, or set LOCAL_RANK"
                )
            chosen = undecided[:1]
        if len(chosen) > 1:
            raise ConfigError(
                f"node {node!r} has several leaders (ranks {chosen}); exactly one rank per node leads "
                "(is_leader=True or LOCAL_RANK=0). Ranks on different hosts need different node_id values"
            )
        leaders[node] = chosen[0]
        for role in roles:
            if role["engines"] and role["rank"] != chosen[0]:
                raise ConfigError(
                    f"rank {role['rank']} holds engines but rank {chosen[0]} leads node {node!r}; give the "
                    "node's engines to its leader (engines=[] elsewhere) or make this rank the leader"
                )
    with_engines = [leaders[node] for node, roles in nodes.items() if any(r["engines"] for r in roles)]
    if not with_engines:
        raise ConfigError("no rank holds engines; pass engines= on the leader of every node that serves")
    return leaders, sorted(set(with_engines) | {src})


def _version_mismatch(version: Any, sent: int, rank: int) -> ConfigError | None:
    if version is None:
        return None
    try:
        if validate_version(version) == sent:
            return None
    except LoraSyncError:
        pass
    return ConfigError(
        f"rank {rank} passed version={version!r} but src publishes version {sent}; pass the same version "
        "(e.g. the trainer step) on every rank, or None on ranks other than src"
    )


# -- collectives -----------------------------------------------------------------------------


def _device(dist: Any, group: Any) -> torch.device:
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_json(dist: Any, obj: Any, group: Any, device: torch.device) -> list[Any]:
    """Every rank's ``obj`` on every rank, in group-rank order (lengths first, then bytes)."""
    size = int(dist.get_world_size(group))
    payload = encode_json(obj, device=device)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(size)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    buffers = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(buffers, padded, group=group)
    return [decode_json(b[: int(n.item())]) for b, n in zip(buffers, lengths)]


def _gather_json(dist: Any, obj: Any, dst: int, group: Any, device: torch.device) -> list[Any] | None:
    """Every member's ``obj`` on global rank ``dst`` (None elsewhere)."""
    size = int(dist.get_world_size(group))
    payload = encode_json(obj, device=device)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(size)]
    dist.all_gather(lengths, length, group=group)  # every member must pad to the same size
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    is_dst = int(dist.get_rank()) == dst
    buffers = [torch.empty_like(padded) for _ in range(size)] if is_dst else None
    dist.gather(padded, buffers, dst=dst, group=group)
    if not is_dst:
        return None
    assert buffers is not None
    return [decode_json(b[: int(n.item())]) for b, n in zip(buffers, lengths)]


def _encode_node(node: NodeResult) -> dict[str, Any]:
    return {
        "node": node.node,
        "rank": node.rank,
        "bytes_received": node.bytes_received,
        "timings": node.timings,
        "error": None if node.error is None else encode_error(node.error),
        "results": [encode_result(r) for r in node.results],
    }


def _decode_node(data: Mapping[str, Any]) -> NodeResult:
    node, rank = str(data["node"]), int(data["rank"])
    return NodeResult(
        node=node,
        rank=rank,
        results=[decode_result(r, node=node, leader_rank=rank) for r in data["results"]],
        bytes_received=int(data["bytes_received"]),
        timings={str(k): float(v) for k, v in dict(data["timings"]).items()},
        error=None if data["error"] is None else decode_error(data["error"], node=node, leader_rank=rank),
    )


def _collective_error(stage: str, exc: BaseException) -> TransportError:
    return TransportError(
        f"a torch.distributed collective failed during {stage} of the distributed publish: {exc}; every rank of "
        "the group must call it with the same name and src, and the leaders' timeout must exceed the slowest "
        "node's local publish"
    )
