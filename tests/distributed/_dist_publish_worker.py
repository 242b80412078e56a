"""Worker for the distributed-publish tests: one process per rank, real gloo process groups,
two simulated nodes with separate roots (no directory is shared between them).

Every rank counts the bytes it hands to torch.distributed collectives (a wrapper around the real
``broadcast`` / ``gather`` / ``all_gather``), so the parent can check what crossed the group.
Leaders dump what their engines serve; ``src`` dumps its reports. The parent judges.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import traceback
from collections.abc import Iterator
from typing import Any

import torch

MODULES = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")] + ["model.layers.1.mlp.down_proj"]
SHAPES = {"q_proj": (64, 64), "v_proj": (32, 64), "down_proj": (64, 128)}  # (out, in)


def make_adapter(seed: int, dtype: torch.dtype = torch.float32, r: int = 4):
    """A deterministic adapter (no model needed): the parent rebuilds the same one."""
    from lorasync import Adapter, AdapterConfig

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module in MODULES:
        out, inp = SHAPES[module.rsplit(".", 1)[-1]]
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, inp, generator=g).to(dtype)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out, r, generator=g).to(dtype)
    return Adapter(tensors, AdapterConfig(r=r, lora_alpha=2 * r))


def _count_collectives(dist: Any, log: list[dict[str, Any]]) -> None:
    """Wrap the collectives the publisher uses; record the bytes this rank sends through each."""
    me = dist.get_rank()

    def size(group: Any) -> int:
        return int(dist.get_world_size(group))

    real_broadcast, real_gather, real_all_gather = dist.broadcast, dist.gather, dist.all_gather

    def broadcast(tensor, src=None, group=None, **kw):
        nbytes = tensor.numel() * tensor.element_size()
        log.append({"op": "broadcast", "world": group is None, "size": size(group), "nbytes": nbytes,
                    "sent": nbytes * (size(group) - 1) if me == src else 0, "received": 0 if me == src else nbytes})
        return real_broadcast(tensor, src=src, group=group, **kw)

    def gather(tensor, gather_list=None, dst=None, group=None, **kw):
        nbytes = tensor.numel() * tensor.element_size()
        log.append({"op": "gather", "world": group is None, "size": size(group), "nbytes": nbytes,
                    "sent": 0 if me == dst else nbytes, "received": 0})
        return real_gather(tensor, gather_list, dst=dst, group=group, **kw)

    def all_gather(tensor_list, tensor, group=None, **kw):
        nbytes = tensor.numel() * tensor.element_size()
        log.append({"op": "all_gather", "world": group is None, "size": size(group), "nbytes": nbytes,
                    "sent": nbytes * (size(group) - 1), "received": 0})
        return real_all_gather(tensor_list, tensor, group=group, **kw)

    dist.broadcast, dist.gather, dist.all_gather = broadcast, gather, all_gather


def _init(rank: int, world: int, port: int, backend: str = "gloo"):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=45),
    )
    return dist


@contextlib.contextmanager
def _reported_errors(out: str, rank: int) -> Iterator[None]:
    """A rank's traceback goes where the parent looks for it (``error-<rank>.txt``), then up."""
    try:
        yield
    except BaseException:
        with open(os.path.join(out, f"error-{rank}.txt"), "w") as fh:
            fh.write(traceback.format_exc())
        raise


def _finish(dist: Any) -> None:
    dist.barrier()
    dist.destroy_process_group()


def _dump(path: str, obj: Any) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1, default=str)


def _served(engines, out: str, tag: str) -> None:
    """What every engine of this leader serves, tensors included (for bit-exact checks)."""
    from safetensors.torch import save_file

    listing = {}
    for i, engine in enumerate(engines):
        listing[engine.url] = {name: engine.path_of(name) for name in engine.list_adapters()}
        for name, adapter in engine.adapters.items():
            save_file({k: t.contiguous() for k, t in adapter.tensors.items()}, os.path.join(out, f"{tag}-{i}-{name}.safetensors"))
    _dump(os.path.join(out, f"{tag}-served.json"), listing)


def _slow_unload_engine(url: str, seconds: float):
    """A MemoryEngine whose unloads take ``seconds``: retirement lags behind ``publish`` as it
    does on a loaded box, so a listing read before the retirement settled shows the old version."""
    import time

    from lorasync.testing import MemoryEngine

    class SlowUnload(MemoryEngine):
        def unload_adapter(self, name: str) -> None:
            time.sleep(seconds)
            super().unload_adapter(name)

    return SlowUnload(url)


def run_memory(rank: int, world: int, port: int, out: str) -> None:
    """Two nodes of two ranks (node from LOCAL_RANK / LOCAL_WORLD_SIZE, as torchrun sets them):
    node 0 = ranks 0, 1 with one MemoryEngine (slow to unload); node 1 = ranks 2, 3 with two."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    os.environ["LOCAL_RANK"] = str(rank % 2)
    os.environ.pop("GROUP_RANK", None)
    with _reported_errors(out, rank):
        dist = _init(rank, world, port)
        from lorasync.distributed import DistributedPublisher
        from lorasync.errors import EngineUnavailableError, LoraSyncError
        from lorasync.testing import MemoryEngine

        node = rank // 2
        engines = []
        if rank % 2 == 0:
            engines = [MemoryEngine(f"memory://node{node}-e{i}") for i in range(1 + node)]
        if rank == 0:  # src leads node 0: its own retirement runs behind its publish
            engines = [_slow_unload_engine("memory://node0-e0", 0.5)]
        root = os.path.join(out, f"root-node{node}")
        timeout = datetime.timedelta(seconds=45)
        log: list[dict[str, Any]] = []
        _count_collectives(dist, log)
        pub = DistributedPublisher(name="policy", engines=engines, root=root, keep=1, timeout=timeout)
        outcome: dict[str, Any] = {"rank": rank, "is_leader": pub.is_leader, "node_id": pub.node_id, "leaders": pub.leaders}

        def step(tag: str, adapter_seed: int | None, version: Any, dtype=torch.float32, others: dict | None = None) -> None:
            start = len(log)
            adapter = make_adapter(adapter_seed, dtype) if rank == 0 and adapter_seed is not None else None
            try:
                report = pub.publish(adapter, version=version if rank == 0 else (others or {}).get(rank))
                outcome[tag] = "none" if report is None else "report"
                if report is not None:
                    _dump(os.path.join(out, f"{tag}-report.json"), report.to_dict())
                    with open(os.path.join(out, f"{tag}-report.txt"), "w") as fh:
                        fh.write(str(report))
            except LoraSyncError as exc:
                outcome[tag] = type(exc).__name__
            _dump(os.path.join(out, f"{tag}-collectives-{rank}.json"), log[start:])
            if engines:
                pub.settled()  # publish returns before old versions are retired; look once they are
                _served(engines, out, f"{tag}-node{node}")

        step("v1", 1, 1)
        if rank == 2:  # node 1's second engine is down for the next load
            engines[1].fail_next("load_adapter", EngineUnavailableError("engine down", engine="memory", url=engines[1].url, attempts=3))
        step("v2-engine-down", 2, 2, torch.bfloat16)
        if rank == 2:  # node 1's leader fails outright (not in an engine) for one publish
            local, real = pub._local, pub._local.publish  # the leader's node-local Publisher

            def boom(*args, **kwargs):
                local.publish = real
                raise RuntimeError("disk on fire")

            local.publish = boom
        step("v3-leader-fails", 3, 3)
        # Ranks other than src may pass the version too; node 1's leader passes a wrong one.
        step("v4-version-mismatch", 4, 4, others={1: 4, 2: 99, 3: 4})
        step("v5", 5, 5)  # every engine catches up
        step("v6-unchanged", 5, 6)
        step("v4-stale", 6, 4)
        step("bad-version", 6, -1)
        step("no-adapter", None, 7)

        # A second publisher whose src is not a leader: rank 1 sends to both leaders.
        start = len(log)
        side = DistributedPublisher(name="side", engines=engines, root=root, src=1, timeout=timeout)
        report = side.publish(make_adapter(7) if rank == 1 else None, version=1)
        if report is not None:
            _dump(os.path.join(out, "side-report.json"), report.to_dict())
        outcome["side"] = "none" if report is None else "report"
        _dump(os.path.join(out, f"side-collectives-{rank}.json"), log[start:])
        _dump(os.path.join(out, f"outcome-{rank}.json"), outcome)
        _finish(dist)


def run_nccl(rank: int, world: int, port: int, out: str) -> None:
    """NCCL, one GPU per rank, one rank per node (each its own leader with one MemoryEngine);
    src is rank 0 and publishes an adapter that lives on its GPU. Every buffer the publisher
    hands to NCCL must be a CUDA tensor: NCCL refuses host memory."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["LOCAL_RANK"] = "0"
    os.environ.pop("GROUP_RANK", None)
    with _reported_errors(out, rank):
        torch.cuda.set_device(rank)
        dist = _init(rank, world, port, backend="nccl")
        from lorasync.distributed import DistributedPublisher
        from lorasync.testing import MemoryEngine

        engines = [MemoryEngine(f"memory://node{rank}-e0")]
        log: list[dict[str, Any]] = []
        _count_collectives(dist, log)
        pub = DistributedPublisher(
            name="policy", engines=engines, root=os.path.join(out, f"root-node{rank}"), keep=1, timeout=datetime.timedelta(seconds=60)
        )
        outcome: dict[str, Any] = {"rank": rank, "is_leader": pub.is_leader, "node_id": pub.node_id, "leaders": pub.leaders}
        for tag, seed, dtype, version in (("v1", 1, torch.float32, 1), ("v2", 2, torch.bfloat16, 2), ("v3-unchanged", 2, torch.bfloat16, 3)):
            start = len(log)
            adapter = make_adapter(seed, dtype).to(device="cuda") if rank == 0 else None
            report = pub.publish(adapter, version=version)
            if report is not None:
                _dump(os.path.join(out, f"{tag}-report.json"), report.to_dict())
            _dump(os.path.join(out, f"{tag}-collectives-{rank}.json"), log[start:])
            _served(engines, out, f"{tag}-node{rank}")
        _dump(os.path.join(out, f"outcome-{rank}.json"), outcome)
        _finish(dist)


def run_vllm(rank: int, world: int, port: int, out: str, vllm_url: str, dead_url: str, adapter_dir: str, probe: dict) -> None:
    """Node "alpha" = ranks 0, 1 (src and leader rank 0) with a VLLMEngine at a dead port;
    node "beta" = ranks 2, 3 (explicit leader: rank 3) with the real vLLM server."""
    with _reported_errors(out, rank):
        dist = _init(rank, world, port)
        from lorasync import Adapter, Probe
        from lorasync.distributed import DistributedPublisher
        from lorasync.engines.vllm import VLLMEngine

        node = "alpha" if rank < 2 else "beta"
        engines = []
        if rank == 0:
            engines = [VLLMEngine(dead_url, retries=1, timeout=5)]
        elif rank == 3:
            engines = [VLLMEngine(vllm_url, timeout=120)]
        pub = DistributedPublisher(
            name="multinode", engines=engines, node_id=node, is_leader=rank in (0, 3),
            root=os.path.join(out, f"root-{node}"), keep=1, transport="disk", timeout=datetime.timedelta(seconds=120),
        )
        adapter = Adapter.load(adapter_dir) if rank == 0 else None
        verify = Probe(tuple(probe["prompt_ids"]), tuple(probe["expected_ids"]), tuple(probe["expected_logprobs"]), probe["atol"])
        report = pub.publish(adapter, version=1, verify=verify if rank == 0 else None)
        if report is not None:
            _dump(os.path.join(out, "report.json"), report.to_dict())
        _dump(os.path.join(out, f"outcome-{rank}.json"), {"report": report is not None, "leaders": pub.leaders})
        pub.close()
        _finish(dist)


def run_raise(rank: int, world: int, port: int, out: str) -> None:
    """Two ranks, one node each (both leaders), ``on_error="raise"``: node 1's engine fails the
    second load. Every rank must raise the same typed error at that publish, then go on."""
    import time

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["LOCAL_RANK"] = "0"
    os.environ.pop("GROUP_RANK", None)
    with _reported_errors(out, rank):
        dist = _init(rank, world, port)
        from lorasync.distributed import DistributedPublisher
        from lorasync.errors import EngineUnavailableError, LoraSyncError
        from lorasync.testing import MemoryEngine

        engine = MemoryEngine(f"memory://node{rank}-e0")
        pub = DistributedPublisher(
            name="policy", engines=[engine], root=os.path.join(out, f"root-node{rank}"), keep=1,
            timeout=datetime.timedelta(seconds=30), on_error="raise",
        )
        outcome: dict[str, Any] = {}
        for version in (1, 2, 3):
            if rank == 1 and version == 2:
                engine.fail_next("load_adapter", EngineUnavailableError("engine down", engine="memory", url=engine.url, attempts=3))
            start = time.monotonic()
            try:
                report = pub.publish(make_adapter(version) if rank == 0 else None, version=version)
                outcome[f"v{version}"] = {"raised": None, "report": None if report is None else report.ok}
            except LoraSyncError as exc:
                outcome[f"v{version}"] = {"raised": type(exc).__name__, "message": str(exc), "context": exc.context}
            outcome[f"v{version}"]["seconds"] = time.monotonic() - start
            pub.settled()
            outcome[f"v{version}"]["served"] = sorted(engine.list_adapters())
        _dump(os.path.join(out, f"raise-outcome-{rank}.json"), outcome)
        pub.close()
        _finish(dist)
