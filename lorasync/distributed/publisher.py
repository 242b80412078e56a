""":class:`DistributedPublisher`: one rank's adapter published on every node's engines.

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
6. With ``on_error="raise"``, ``src`` broadcasts its report's failure over ``group``
   (:mod:`._agree`) and every rank raises the same typed error, so none goes on alone into the
   next collective.

With NCCL every buffer lives on the current CUDA device; with gloo on the CPU.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from lorasync.adapter._adapter import Adapter
from lorasync.runtime._collectives import all_gather_json, collective_device, decode_json, encode_json, gather_json
from lorasync.adapter._names import served_name, validate_name, validate_version
from lorasync.adapter._probe import Probe
from lorasync.publisher._publisher import Publisher
from lorasync.publisher._select import TRANSPORTS
from lorasync.publisher._report import EngineResult
from lorasync.distributed._agree import agree_on_error
from lorasync.distributed._report import DistributedPublishReport, NodeResult, decode_node, encode_node
from lorasync.distributed._roles import check_options, default_leader, default_node, leaders_group, resolve, version_mismatch
from lorasync.distributed._wire import decode_adapter, decode_error, encode_adapter, encode_error
from lorasync.engines._engine import Engine
from lorasync.engines._group import EngineGroup
from lorasync.errors import ConfigError, LoraSyncError, PublishError, TransportError

__all__ = ["LOCAL_TRANSPORTS", "DistributedPublisher"]

# A leader publishes with an ordinary Publisher: every transport but the merged fallback, which
# needs base weights on every node.
LOCAL_TRANSPORTS = tuple(t for t in TRANSPORTS if t != "merged")
_OK, _REFUSED = 0, 1
_ON_ERROR = ("report", "raise")


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
            (default ``/dev/shm/lorasync-<uid>``, tmpfs, per user).
        keep (`int`): versions each engine keeps loaded.
        transport (`str`): ``"auto"``, ``"disk"`` or ``"ipc"`` for this leader's engines.
        src (`int`): global rank that holds the adapter and receives the report.
        verify (`Probe`, *optional*): default probe, sent along with the adapter and checked
            through every engine after loading.
        timeout (`datetime.timedelta`, *optional*): timeout of the leaders' group; it must exceed
            the slowest node's local publish (engine retries included). Default: torch's.
        on_error (`str`): ``"report"`` (default: engine failures are in ``src``'s report, no rank
            raises) or ``"raise"``: when any engine failed, every rank of ``group`` raises the same
            typed error (one more small broadcast per publish), so no rank is left waiting in
            the next collective for one that raised.

    Raises:
        ConfigError: torch.distributed is not initialised, or the ranks' configuration does not fit
            (no or several leaders on a node, engines on a non-leader, different names or ``src``,
            no engines anywhere, different ``on_error``). Raised on every rank.
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
        on_error: str = "report",
    ) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("DistributedPublisher needs an initialised torch.distributed process group (init_process_group)")
        self.group = group
        self.src = src
        self.verify = verify
        self.on_error = on_error
        self.rank = int(dist.get_rank())
        self._device = collective_device(dist, group)
        if isinstance(engines, (Engine, EngineGroup, str)):
            engines = [engines]
        engines = list(engines)
        self.node_id = str(node_id) if node_id is not None else default_node(self.rank)
        self._local: Publisher | None = None
        self._last_local: Any = None  # this leader's last node-local PublishReport
        problem: dict[str, Any] | None = None
        try:  # a local mistake must reach every rank, or the others would wait for this one
            self.name = validate_name(name)
            check_options(src=src, is_leader=is_leader, verify=verify, timeout=timeout)
            if on_error not in _ON_ERROR:
                raise ConfigError(f"on_error must be one of {_ON_ERROR}, got {on_error!r}")
            if transport not in LOCAL_TRANSPORTS:
                raise ConfigError(
                    f"transport must be one of {LOCAL_TRANSPORTS} for node-local engines, got {transport!r} "
                    "(the merged fallback needs base weights on every node and is not distributed)"
                )
            if engines:
                self._local = Publisher(engines, name=name, transport=transport, keep=keep, root=root)
        except LoraSyncError as exc:
            problem = encode_error(exc)
        role = {
            "rank": self.rank,
            "node": self.node_id,
            "leader": default_leader() if is_leader is None else is_leader is True,
            "engines": len(engines),
            "name": name if isinstance(name, str) else repr(name),
            "src": src,
            "on_error": on_error if isinstance(on_error, str) else repr(on_error),
            "problem": problem,
        }
        try:
            everyone = all_gather_json(dist, role, group, self._device)
        except RuntimeError as exc:
            raise _collective_error("construction", exc) from exc
        self.leaders, members = resolve(everyone, src)
        self.is_leader = self.leaders.get(self.node_id) == self.rank
        self.members = members
        try:
            self._sub: Any = leaders_group(dist, group, members, self.rank, timeout)
        except RuntimeError as exc:
            raise _collective_error("creating the leaders' group", exc) from exc

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
            `DistributedPublishReport` on ``src``; None on every other rank. With
            ``on_error="report"`` engine failures are reported, not raised; calling
            ``report.raise_for_errors()`` raises them on ``src`` only, so make every rank stop
            too (or use ``on_error="raise"``).

        Raises:
            InvalidNameError, ConfigError, AdapterError, ExportError: ``src``'s adapter or version
                was refused (nothing was sent); raised on every rank.
            ConfigError: this rank passed a version other than ``src``'s (raised once the
                collective has completed; a leader reports its engines failed with it).
            TransportError: a collective failed (a rank died or the timeout is too short).
            EngineError, PublishError (or another ``lorasync.errors`` class): with
                ``on_error="raise"``, some engine failed; raised on every rank of ``group``
                (``report.raise_for_errors()``'s error, rebuilt from its class, message and
                context on the other ranks).
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
        mismatch = None if is_src else version_mismatch(version, sent_version, self.rank)
        if self._sub is None and not is_src and self._local is None:
            self._agree(None)
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
                gathered = gather_json(
                    dist, None if mine is None or is_src else encode_node(mine), self.src, self._sub, self._device
                )
            else:
                gathered = None
            timings["gather"] = time.perf_counter() - t0
        except RuntimeError as exc:
            raise _collective_error("the payload broadcast or the results gather", exc) from exc
        if not is_src:
            self._agree(None)
            if mismatch is not None:
                raise mismatch
            return None
        assert isinstance(adapter, Adapter) and payload is not None
        for item in gathered or []:
            if item is not None:
                node_results.append(decode_node(item))
        if mine is not None:
            node_results.append(mine)
        node_results.sort(key=lambda n: n.rank)
        results = [replace(r, url=f"[{n.node}] {r.url}") for n in node_results for r in n.results]
        names = {r.served_name for r in results if r.ok and r.served_name}
        timings["total"] = time.perf_counter() - start
        report = DistributedPublishReport(
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
        self._agree(report)
        return report

    def _agree(self, report: DistributedPublishReport | None) -> None:
        """With ``on_error="raise"``: ``src``'s failure (from ``report``) raised on every rank."""
        if self.on_error != "raise":
            return
        failure = None
        if report is not None:
            try:
                report.raise_for_errors()
            except LoraSyncError as exc:
                failure = exc
        failure = agree_on_error(failure, src=self.src, group=self.group)
        if failure is not None:
            raise failure

    def settled(self, timeout: float | None = None) -> None:
        """Wait until this leader's last node-local publish retired its old versions (and
        collected their files): ``publish`` returns before that, so look at this node's engines
        after this. Not collective; returns at once on ranks without engines.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
        """
        if self._last_local is not None:
            self._last_local.settled(timeout)

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
            self._last_local = report
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


def _collective_error(stage: str, exc: BaseException) -> TransportError:
    return TransportError(
        f"a torch.distributed collective failed during {stage} of the distributed publish: {exc}; every rank of "
        "the group must call it with the same name and src, and the leaders' timeout must exceed the slowest "
        "node's local publish"
    )
