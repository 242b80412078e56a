""":class:`DistributedFleet`: many tenants' adapters from one rank to every node's engines.

The multi-LoRA :class:`~lorasync.Fleet` over torch.distributed, as :class:`DistributedPublisher`
is the single adapter's: one leader per node holds a node-local ``Fleet`` over its engines and
serves every tenant there (one slot budget, one connection per engine, restores, isolation);
``src`` holds the trainers' adapters. Every call is collective (every rank of ``group`` makes it):

1. ``src`` broadcasts the call over ``group`` as JSON. For ``publish`` that is each tenant's
   version and which tenants changed: ``src`` remembers the content hash of each tenant's
   current version (once every node serves it), so an unchanged tenant crosses no network and
   keeps its version. One given a probe crosses all the same: "unchanged" counts only after the
   probe passes, and each node's fleet runs it (as :meth:`Fleet.publish` does). A refusal there (an unknown tenant, a missing version) is raised on every
   rank before anything is sent.
2. ``src`` broadcasts each changed adapter once within the leaders' group.
3. Each leader runs the call on its node-local fleet. A failure becomes that node's report,
   never an exception, so the collective always completes.
4. The leaders' reports are gathered on ``src``: a :class:`DistributedFleetReport` (tenant, then
   node). ``register`` and ``retire`` then agree on the first failure and raise it on every rank
   (a registration refused by one node is rolled back on the others).

With NCCL every buffer lives on the current CUDA device; with gloo on the CPU.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lorasync.adapter._adapter import Adapter
from lorasync.runtime._collectives import all_gather_json, collective_device, decode_json, encode_json, gather_json
from lorasync.publisher._digest import PublishDigest
from lorasync.fleet._fleet import Fleet
from lorasync.fleet._plan import FleetReport, TenantReport
from lorasync.fleet._round import check_round
from lorasync.adapter._probe import Probe
from lorasync.distributed._agree import agree_on_error
from lorasync.distributed._fleet_report import DistributedFleetReport, decode_tenants, encode_tenants
from lorasync.distributed._roles import check_options, default_leader, default_node, leaders_group, resolve
from lorasync.distributed._wire import decode_adapter, decode_error, encode_adapter, encode_error
from lorasync.engines._engine import Engine
from lorasync.engines._group import EngineGroup
from lorasync.errors import ConfigError, ExportError, LoraSyncError, PublishError, TransportError

__all__ = ["DistributedFleet"]

AdapterLike = Adapter | nn.Module | Mapping[str, torch.Tensor]


class DistributedFleet:
    """Publish many tenants' adapters from one rank to engines on every node (collective).

    Args:
        group (`ProcessGroup`, *optional*): the ranks that publish together (default: the job).
        engines: this rank's node-local engines; only a node's leader may hold engines.
        node_id, is_leader: as for :class:`DistributedPublisher` (default from torchrun's variables).
        root (`str | os.PathLike`, *optional*): node-local disk root of this leader's fleet.
        transport (`str`): ``"auto"``, ``"disk"`` or ``"ipc"`` for this leader's engines.
        src (`int`): global rank that holds the adapters and receives the reports.
        timeout (`datetime.timedelta`, *optional*): of the leaders' group; it must exceed the
            slowest node's round.

    Raises:
        ConfigError: torch.distributed is not initialised, or the ranks' roles do not fit (see
            :class:`DistributedPublisher`); raised on every rank.

    Example:
        >>> fleet = DistributedFleet(engines=["vllm:http://127.0.0.1:8000"] if local_rank == 0 else [])  # doctest: +SKIP
        >>> fleet.register("gsm8k", keep=1); fleet.register("dapo", keep=1)  # doctest: +SKIP
        >>> report = fleet.publish(adapters if rank == 0 else None, versions={"gsm8k": step, "dapo": step})  # doctest: +SKIP
    """

    def __init__(
        self,
        group: Any = None,
        *,
        engines: Iterable[Engine | str] | Engine | str = (),
        node_id: str | int | None = None,
        is_leader: bool | None = None,
        root: str | os.PathLike[str] | None = None,
        transport: str = "auto",
        src: int = 0,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("DistributedFleet needs an initialised torch.distributed process group (init_process_group)")
        self.group, self.src = group, src
        self.rank = int(dist.get_rank())
        self._device = collective_device(dist, group)
        engines = [engines] if isinstance(engines, (Engine, EngineGroup, str)) else list(engines)
        self.node_id = str(node_id) if node_id is not None else default_node(self.rank)
        self.local: Fleet | None = None  # this leader's node-local fleet
        self.tenants: list[str] = []  # registered, in order (the same on every rank)
        self._hashes: dict[str, str] = {}  # on src: each tenant's current content, served on every node
        self._pending: dict[str, str] = {}  # on src: the hashes of the round in flight
        problem = None
        try:  # a local mistake must reach every rank, or the others would wait for this one
            check_options(src=src, is_leader=is_leader, verify=None, timeout=timeout)
            if engines:
                self.local = Fleet(engines, transport=transport, root=root)
        except LoraSyncError as exc:
            problem = encode_error(exc)
        role = {"rank": self.rank, "node": self.node_id, "leader": default_leader() if is_leader is None else is_leader is True,
                "engines": len(engines), "name": "fleet", "src": src, "on_error": "report", "problem": problem}  # fmt: skip
        try:
            everyone = all_gather_json(dist, role, group, self._device)
            self.leaders, self.members = resolve(everyone, src)
            self._sub = leaders_group(dist, group, self.members, self.rank, timeout)
        except RuntimeError as exc:
            raise _collective_error("construction", exc) from exc
        self.is_leader = self.leaders.get(self.node_id) == self.rank

    # -- tenants ------------------------------------------------------------------------------------

    def register(self, name: str, *, keep: int = 2, max_staleness: int | None = None, grace: float = 1.0, drain_timeout: float | None = 600.0) -> None:
        """Register ``name`` on every node's fleet (collective; ``src``'s arguments count).

        Raises:
            ConfigError, CapacityError, InvalidNameError: a node refused it (typed, naming the
                node); raised on every rank, and the nodes that had registered it retire it again.
        """
        call = self._broadcast({"op": "register", "name": name, "options": {"keep": keep, "max_staleness": max_staleness, "grace": grace, "drain_timeout": drain_timeout}})
        done, failure = False, None
        if self.local is not None:
            try:
                self.local.register(call["name"], **call["options"])
                done = True
            except LoraSyncError as exc:
                failure = exc
        failure = self._agree(self._first_failure(failure))
        if failure is not None:
            if done and self.local is not None:
                self.local.retire(call["name"], timeout=0)  # nothing published yet: nothing to drain
            raise failure
        self.tenants.append(call["name"])

    def retire(self, name: str, *, timeout: float | None = None) -> None:
        """Retire ``name`` on every node (collective): each leader drains and unloads it as
        :meth:`Fleet.retire` does.

        Raises:
            ConfigError: no such tenant. EngineError: a node failed (the tenant stays registered
                there: call ``retire`` again); raised on every rank.
        """
        call = self._broadcast({"op": "retire", "name": name, "timeout": timeout})
        if call["name"] not in self.tenants:
            failure: LoraSyncError | None = ConfigError(f"no tenant {call['name']!r} in this distributed fleet (registered: {', '.join(self.tenants) or 'none'})")
        else:
            failure = None
            if self.local is not None:
                try:
                    self.local.retire(call["name"], timeout=call["timeout"])
                except LoraSyncError as exc:
                    failure = exc
            failure = self._agree(self._first_failure(failure))
        if failure is not None:
            raise failure
        self.tenants.remove(call["name"])
        self._hashes.pop(call["name"], None)

    # -- rounds ---------------------------------------------------------------------------------------

    def publish(
        self, adapters: Mapping[str, AdapterLike] | None = None, *, versions: Mapping[str, int] | None = None, verify: Mapping[str, Probe] | None = None
    ) -> DistributedFleetReport | None:
        """One round on every node (collective): the tenants whose content changed cross the
        process group once per node and are published there; the others keep their version.

        Args:
            adapters: on ``src``, ``{tenant: adapter}``; None on other ranks.
            versions: on ``src``, ``{tenant: version}`` for every tenant in ``adapters``.
            verify: on ``src``, ``{tenant: Probe}``: it travels with the tenant's adapter and
                every engine of every node is checked against it after the load.

        Returns:
            `DistributedFleetReport` on ``src`` (tenant failures are reported, not raised); None
            on every other rank.

        Raises:
            ConfigError: ``src`` passed an unknown tenant or no version; raised on every rank,
                nothing was sent.
            TransportError: a collective failed.
        """
        import torch.distributed as dist

        call: dict[str, Any] = {"op": "publish", "versions": {}, "sizes": {}, "failed": {}, "error": None}
        payloads: dict[str, torch.Tensor] = {}
        if self.rank == self.src:
            try:
                payloads = self._payloads(call, adapters, versions, verify)
            except LoraSyncError as exc:
                call["error"] = encode_error(exc)
        call = self._broadcast(call)
        if call["error"] is not None:
            raise decode_error(call["error"], rank=self.src)
        bytes_sent = 0
        try:
            if self._sub is not None:
                for name in sorted(call["sizes"]):
                    buffer = payloads[name] if self.rank == self.src else torch.empty(call["sizes"][name], dtype=torch.uint8, device=self._device)
                    dist.broadcast(buffer, src=self.src, group=self._sub)
                    payloads[name] = buffer
                    bytes_sent += buffer.numel() * (len(self.members) - 1)
        except RuntimeError as exc:
            raise _collective_error("the adapters' broadcast", exc) from exc
        received, broken = self._decoded(payloads, call["sizes"])
        changed = {n: adapter for n, (adapter, _) in received.items()}
        probes = {n: probe for n, (_, probe) in received.items() if probe is not None}

        def run(fleet: Fleet) -> FleetReport:
            local = fleet.publish(changed, versions={n: call["versions"][n] for n in changed}, verify=probes)
            for name, error in broken.items():  # this node got no adapter for it: it fails here alone
                t = fleet.tenants[name]
                local.tenants[name] = TenantReport(name, t.registration, "failed", t.version, t.served_name, error=error)
            return local

        report = self._gathered(run, unchanged=[n for n in call["versions"] if n not in call["sizes"]])
        if report is None:
            return None
        report.sent, report.bytes_sent = sorted(call["sizes"]), bytes_sent
        for name, failed in call["failed"].items():  # refused on src (e.g. no LoRA to export): failed alone
            error = decode_error(failed)
            report.tenants[name] = {node: TenantReport(name, "", "failed", None, error=error) for node in self.leaders}
        for name in call["sizes"]:  # remembered once every node serves it: then it need not cross again
            nodes = report.tenants.get(name, {}).values()
            if all(t.ok and t.version == call["versions"][name] for t in nodes):
                self._hashes[name] = self._pending[name]
            elif not all(t.ok for t in nodes):
                # A node failed it (a probe of unchanged content, say): what it serves is no
                # longer known here, so the next round sends it again and that node decides.
                self._hashes.pop(name, None)
        return report

    def restore(self) -> DistributedFleetReport | None:
        """Every node loads its tenants' current versions again where its engines lost them
        (collective). Returns the report on ``src``, None elsewhere."""
        self._broadcast({"op": "restore"})
        return self._gathered(lambda fleet: fleet.restore(), unchanged=[])

    def close(self) -> None:
        """Close this leader's fleet (not collective; the process groups belong to the trainer)."""
        if self.local is not None:
            self.local.close()

    def __enter__(self) -> DistributedFleet:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- parts ----------------------------------------------------------------------------------------

    def _payloads(self, call: dict[str, Any], adapters: Any, versions: Any, verify: Any) -> dict[str, torch.Tensor]:
        """On ``src``: check the round as :meth:`Fleet.publish` does (before anything is sent),
        fill ``call`` (versions, sizes of the changed tenants, tenants failed here) and serialise
        what changed. Hash and serialisation read the trainer's tensors under one torn-read watch
        (the publisher's :class:`~lorasync.publisher._digest.PublishDigest`): a tenant whose tensors changed
        meanwhile fails alone, and nothing of a mix of two steps crosses."""
        from lorasync.exporters.fsdp import export

        self._pending = {}
        payloads = {}
        checked = check_round(adapters, versions, verify, known=self._known)
        probes: Mapping[str, Probe] = verify or {}
        for name, adapter in adapters.items():
            call["versions"][name] = checked[name]
            try:
                if not isinstance(adapter, Adapter):
                    adapter = export(adapter)
                watched = PublishDigest(adapter)
                digest = watched.hash_now(lambda a: a.content_hash)
                if digest == self._hashes.get(name) and name not in probes:
                    continue  # every node serves this content: nothing crosses, the version stays
                # Changed, or unchanged with a probe: each node's Fleet verifies an unchanged
                # tenant given a probe at its current version before it says "unchanged".
                payload = encode_adapter(adapter, probe=probes.get(name), device=self._device)
                if (torn := watched.changed()) is not None:
                    raise watched.error(torn, "while they were serialised for the other nodes")
                payloads[name] = payload
                call["sizes"][name], self._pending[name] = int(payloads[name].numel()), digest
            except Exception as exc:  # this tenant alone, and broadcast: src must never raise alone (the ranks would fall out of step)
                error = exc if isinstance(exc, LoraSyncError) else ExportError(f"tenant {name!r}: cannot export its adapter: {type(exc).__name__}: {exc}")
                call["failed"][name] = encode_error(error)
                del call["versions"][name]
        return payloads

    def _known(self, name: str) -> None:
        if name not in self.tenants:
            raise ConfigError(f"no tenant {name!r} in this distributed fleet (registered: {', '.join(self.tenants) or 'none'}); register it first (on every rank)")

    def _decoded(self, payloads: dict[str, torch.Tensor], sizes: Mapping[str, int]) -> tuple[dict[str, tuple[Adapter, Probe | None]], dict[str, LoraSyncError]]:
        """The adapters a leader received, and the tenants whose bytes did not decode (each fails
        on this node alone: a leader that raised here would skip the reports' gather that src and
        the other leaders wait in, until the group's timeout)."""
        received: dict[str, tuple[Adapter, Probe | None]] = {}
        broken: dict[str, LoraSyncError] = {}
        if self.local is None:
            return received, broken
        for name in sizes:
            try:
                received[name] = decode_adapter(payloads[name])
            except Exception as exc:  # noqa: BLE001 - this tenant's, on this node
                broken[name] = exc if isinstance(exc, LoraSyncError) else TransportError(
                    f"{name}: the adapter node {self.node_id} (rank {self.rank}) received did not decode ({type(exc).__name__}: {exc}); "
                    "it keeps serving its previous version there, and the next publish sends it again"
                )
        return received, broken

    def _gathered(self, run: Any, *, unchanged: list[str]) -> DistributedFleetReport | None:
        """Run ``run(local_fleet)`` on each leader and gather the node reports on ``src``."""
        mine = None
        if self.local is not None:
            try:
                local: FleetReport = run(self.local)
                for name in unchanged:
                    if name not in local.tenants:
                        t = self.local.tenants[name]
                        local.tenants[name] = TenantReport(name, t.registration, "unchanged", t.version, t.served_name)
                mine = {"node": self.node_id, "rank": self.rank, "tenants": encode_tenants(local), "error": None}
            except Exception as exc:  # never leave src waiting: the node's report says it failed
                error = exc if isinstance(exc, LoraSyncError) else PublishError(f"node {self.node_id} (rank {self.rank}) failed: {type(exc).__name__}: {exc}")
                mine = {"node": self.node_id, "rank": self.rank, "tenants": {}, "error": encode_error(error)}
        nodes = self._gather(mine)
        if nodes is None:
            return None
        report = DistributedFleetReport()
        for node in nodes:
            if node["error"] is not None:
                error = decode_error(node["error"], node=node["node"], leader_rank=node["rank"])
                for name in self.tenants:
                    report.tenants.setdefault(name, {})[node["node"]] = TenantReport(name, "", "failed", None, error=error)
                continue
            for name, t in decode_tenants(node["tenants"], node=node["node"], rank=node["rank"]).items():
                report.tenants.setdefault(name, {})[node["node"]] = t
        return report

    def _gather(self, mine: Any) -> list[Any] | None:
        """The leaders' node reports on ``src`` (None elsewhere)."""
        import torch.distributed as dist

        if self.rank not in self.members:
            return None
        try:
            got = gather_json(dist, mine, self.src, self._sub, self._device) if self._sub is not None else [mine]
        except RuntimeError as exc:
            raise _collective_error("the reports' gather", exc) from exc
        return None if got is None else [g for g in got if g is not None]

    def _first_failure(self, mine: LoraSyncError | None) -> LoraSyncError | None:
        """On ``src``: the first node failure (its error, naming the node); None elsewhere."""
        nodes = self._gather(None if self.local is None else {"node": self.node_id, "rank": self.rank, "error": None if mine is None else encode_error(mine)})
        for node in nodes or ():
            if node["error"] is not None:
                return decode_error(node["error"], node=node["node"], leader_rank=node["rank"])
        return None

    def _agree(self, failure: LoraSyncError | None) -> LoraSyncError | None:
        return agree_on_error(failure, src=self.src, group=self.group)

    def _broadcast(self, call: dict[str, Any]) -> dict[str, Any]:
        """``src``'s ``call`` on every rank of ``group`` (length first, then the JSON)."""
        import torch.distributed as dist

        is_src = self.rank == self.src
        message = encode_json(call if is_src else None, device=self._device)
        try:
            size = torch.tensor([message.numel()], dtype=torch.int64, device=self._device)
            dist.broadcast(size, src=self.src, group=self.group)
            if not is_src:
                message = torch.empty(int(size.item()), dtype=torch.uint8, device=self._device)
            dist.broadcast(message, src=self.src, group=self.group)
        except RuntimeError as exc:
            raise _collective_error(f"the {call.get('op', 'call')} broadcast", exc) from exc
        return call if is_src else decode_json(message)  # type: ignore[no-any-return]


def _collective_error(stage: str, exc: BaseException) -> TransportError:
    return TransportError(
        f"a torch.distributed collective failed during {stage} of the distributed fleet: {exc}; every rank of the "
        "group must make the same calls in the same order (register, publish, retire, restore), and the leaders' "
        "timeout must exceed the slowest node's round"
    )
