"""Who does what in a distributed publish: each rank's node, the node leaders, and the checks
that every rank agrees (same name, same ``src`` and ``on_error``, one leader per node, engines only on leaders).

Every rank sees the same gathered roles, so each raises the same ``ConfigError``.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from lorasync.adapter._names import validate_version
from lorasync.distributed._wire import decode_error
from lorasync.errors import ConfigError, LoraSyncError

__all__ = ["check_options", "default_leader", "default_node", "leaders_group", "resolve", "version_mismatch"]


def default_node(rank: int) -> str:
    env = os.environ
    if env.get("GROUP_RANK", "").isdigit():
        return env["GROUP_RANK"]
    if env.get("LOCAL_WORLD_SIZE", "").isdigit() and int(env["LOCAL_WORLD_SIZE"]) > 0:
        return str(rank // int(env["LOCAL_WORLD_SIZE"]))
    return socket.gethostname()


def default_leader() -> bool | None:
    local = os.environ.get("LOCAL_RANK", "")
    return int(local) == 0 if local.isdigit() else None


def resolve(everyone: list[dict[str, Any]], src: int) -> tuple[dict[str, int], list[int]]:
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
    on_errors = {role.get("on_error", "report") for role in everyone}
    if len(on_errors) != 1:  # "raise" adds a collective: a rank without it would wait there alone
        raise ConfigError(f"ranks pass different on_error= values {sorted(on_errors)}; pass the same on_error on every rank")
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


def version_mismatch(version: Any, sent: int, rank: int) -> ConfigError | None:
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


def check_options(*, src: object, is_leader: object, verify: object, timeout: object) -> None:
    """The DistributedPublisher options that are not a Publisher's, checked where they are given
    (a float rank passed the membership test, ``"no"`` counted as a leader, any object as a probe).

    Raises:
        ConfigError: naming the option and what to pass.
    """
    import datetime

    from lorasync.adapter._probe import Probe

    if isinstance(src, bool) or not isinstance(src, int):
        raise ConfigError(f"src must be the int global rank whose adapter is published, got {src!r} ({type(src).__name__})")
    if is_leader is not None and not isinstance(is_leader, bool):
        raise ConfigError(f"is_leader must be True, False or None (one leader per node by default), got {is_leader!r}")
    if verify is not None and not isinstance(verify, Probe):
        raise ConfigError(f"verify must be a lorasync.Probe or None, got {type(verify).__name__}")
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise ConfigError(f"timeout must be a datetime.timedelta or None, got {timeout!r} ({type(timeout).__name__})")


def leaders_group(dist: Any, group: Any, members: list[int], rank: int, timeout: Any) -> Any:
    """The leaders' process group (``members``: the leaders with engines, and ``src``), on its
    members; None elsewhere or when ``src`` is its only member. Collective over ``group``: with the
    default group every rank of the job calls ``new_group``, as torch requires.

    Raises:
        RuntimeError: torch could not make the group (the caller reports it typed).
    """
    if len(members) <= 1:
        return None
    if group is None or group is dist.group.WORLD:
        sub = dist.new_group(members, timeout=timeout)
    elif rank in members:
        sub = dist.new_group(members, timeout=timeout, use_local_synchronization=True)
    else:
        sub = None
    return sub if rank in members else None
