"""DistributedPublisher under real torch.distributed: 4 gloo ranks simulate 2 nodes with separate
roots (no directory shared). Node 0 = ranks 0, 1 (one MemoryEngine), node 1 = ranks 2, 3 (two),
leaders from LOCAL_RANK / LOCAL_WORLD_SIZE as torchrun sets them; src is rank 0.

One spawn runs every publish in sequence (process start-up dominates on a small box); the
workers dump what each engine serves and what crossed the process group, the tests judge.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

import torch
from _dist_publish_worker import make_adapter, run_memory
from safetensors.torch import load, load_file

from lorasync.distributed import encode_adapter

DEADLINE_S = 75
ENGINES = {0: ["memory://node0-e0"], 1: ["memory://node1-e0", "memory://node1-e1"]}


@pytest.fixture(scope="module")
def out(tmp_path_factory, spawn_ranks):
    path = tmp_path_factory.mktemp("multinode")
    took = spawn_ranks(run_memory, (str(path),), nprocs=4, out=path, deadline_s=DEADLINE_S)
    assert took < DEADLINE_S
    return path


def report(out, tag):
    return json.loads((out / f"{tag}-report.json").read_text())


def served(out, tag, node):
    return json.loads((out / f"{tag}-node{node}-served.json").read_text())


def served_tensors(out, tag, node, engine, name):
    return load_file(str(out / f"{tag}-node{node}-{engine}-{name}.safetensors"))


def statuses(rep):
    return {r["url"]: r["status"] for r in rep["results"]}


def assert_bit_exact(got, adapter):
    assert sorted(got) == sorted(adapter.tensors)
    for key, tensor in adapter.tensors.items():
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key].view(torch.uint8), tensor.view(torch.uint8)), key  # bits, not values


def test_roles_from_local_rank(out):
    for rank in range(4):
        outcome = json.loads((out / f"outcome-{rank}.json").read_text())
        assert outcome["leaders"] == {"0": 0, "1": 2}
        assert outcome["node_id"] == str(rank // 2) and outcome["is_leader"] == (rank % 2 == 0)


def test_every_node_serves_the_source_adapter_bit_for_bit(out):
    for tag, version, seed, dtype in (("v1", 1, 1, torch.float32), ("v5", 5, 5, torch.float32)):
        rep = report(out, tag)
        assert rep["ok"] and rep["served_name"] == f"policy@v{version}"
        assert statuses(rep) == {f"[{n}] {u}": "loaded" for n, urls in ENGINES.items() for u in urls}
        for node, urls in ENGINES.items():
            listing = served(out, tag, node)
            for i, url in enumerate(urls):
                # keep=1: the new version only, loaded from this node's own root
                assert list(listing[url]) == [f"policy@v{version}"]
                loaded_from = Path(listing[url][f"policy@v{version}"])  # <root>/<name>/<run>/vN of this node's leader
                assert loaded_from.parent.parent == out / f"root-node{node}" / "policy" and loaded_from.name == f"v{version}"
                assert_bit_exact(served_tensors(out, tag, node, i, f"policy@v{version}"), make_adapter(seed, dtype))
    # Separate roots: each node's root holds only what its own leader wrote.
    for node in ENGINES:
        runs = list((out / f"root-node{node}" / "policy").iterdir())
        assert len(runs) == 1 and sorted(p.name for p in runs[0].iterdir() if p.is_dir()) == ["v5"]


def test_engine_down_on_one_node_is_reported_and_the_rest_load(out):
    rep = report(out, "v2-engine-down")
    assert not rep["ok"]
    assert statuses(rep) == {"[0] memory://node0-e0": "loaded", "[1] memory://node1-e0": "loaded", "[1] memory://node1-e1": "failed"}
    failed = rep["results"][2]
    assert failed["error"] == {"type": "EngineUnavailableError", "message": "engine down"}
    adapter = make_adapter(2, torch.bfloat16)
    assert_bit_exact(served_tensors(out, "v2-engine-down", 0, 0, "policy@v2"), adapter)
    assert_bit_exact(served_tensors(out, "v2-engine-down", 1, 0, "policy@v2"), adapter)
    # The failed engine keeps serving its previous version.
    assert list(served(out, "v2-engine-down", 1)["memory://node1-e1"]) == ["policy@v1"]
    assert_bit_exact(served_tensors(out, "v2-engine-down", 1, 1, "policy@v1"), make_adapter(1))


def test_a_failing_leader_is_reported_without_blocking_others(out):
    rep = report(out, "v3-leader-fails")
    assert statuses(rep) == {"[0] memory://node0-e0": "loaded", "[1] memory://node1-e0": "failed", "[1] memory://node1-e1": "failed"}
    node1 = rep["nodes"][1]
    assert node1["node"] == "1" and node1["rank"] == 2 and node1["bytes_received"] == rep["payload_bytes"]
    assert node1["error"]["type"] == "PublishError" and "RuntimeError: disk on fire" in node1["error"]["message"]
    # node 1's engines were not touched; node 0 moved on
    assert {u: list(v) for u, v in served(out, "v3-leader-fails", 1).items()} == {
        "memory://node1-e0": ["policy@v2"], "memory://node1-e1": ["policy@v1"]
    }
    assert list(served(out, "v3-leader-fails", 0)["memory://node0-e0"]) == ["policy@v3"]


def test_a_rank_with_another_version_fails_its_node_only(out):
    rep = report(out, "v4-version-mismatch")
    assert statuses(rep) == {"[0] memory://node0-e0": "loaded", "[1] memory://node1-e0": "failed", "[1] memory://node1-e1": "failed"}
    assert rep["nodes"][1]["error"]["type"] == "ConfigError" and "version=99" in rep["nodes"][1]["error"]["message"]
    outcomes = [json.loads((out / f"outcome-{r}.json").read_text())["v4-version-mismatch"] for r in range(4)]
    assert outcomes == ["report", "none", "ConfigError", "none"]


def test_versions_stay_monotonic_and_unchanged_content_moves_nothing(out):
    rep = report(out, "v6-unchanged")
    assert rep["ok"] and set(statuses(rep).values()) == {"unchanged"}
    assert rep["served_name"] == "policy@v5" and rep["bytes_moved"] == 0
    stale = report(out, "v4-stale")
    assert set(statuses(stale).values()) == {"failed"}
    assert {r["error"]["type"] for r in stale["results"]} == {"StaleVersionError"}
    for node, urls in ENGINES.items():  # nothing changed anywhere
        listing = served(out, "v4-stale", node)
        for i, url in enumerate(urls):
            assert list(listing[url]) == ["policy@v5"]
            assert_bit_exact(served_tensors(out, "v4-stale", node, i, "policy@v5"), make_adapter(5))


def test_refusals_on_src_raise_on_every_rank(out):
    outcomes = [json.loads((out / f"outcome-{r}.json").read_text()) for r in range(4)]
    assert [o["bad-version"] for o in outcomes] == ["InvalidNameError"] * 4
    assert [o["no-adapter"] for o in outcomes] == ["ConfigError"] * 4
    # nothing but the header and the error travelled
    for tag in ("bad-version", "no-adapter"):
        for rank in range(4):
            log = json.loads((out / f"{tag}-collectives-{rank}.json").read_text())
            assert [c["op"] for c in log] == ["broadcast"] * 3 and all(c["world"] for c in log)


@pytest.mark.parametrize(
    "tag,seed,dtype,src,receivers",
    [
        ("v1", 1, torch.float32, 0, 1),
        ("v2-engine-down", 2, torch.bfloat16, 0, 1),
        ("v5", 5, torch.float32, 0, 1),
        ("v6-unchanged", 5, torch.float32, 0, 1),
        ("side", 7, torch.float32, 1, 2),  # src is no leader: both nodes receive
    ],
)
def test_bytes_over_the_group_are_one_adapter_per_receiving_node(out, tag, seed, dtype, src, receivers):
    adapter = make_adapter(seed, dtype)
    serialized = encode_adapter(adapter)
    blob = serialized.numpy().tobytes()
    # the serialized form is a plain safetensors file: header + tensor data, nothing else
    (header_len,) = struct.unpack("<Q", blob[:8])
    assert len(blob) == 8 + header_len + adapter.nbytes
    parsed = load(blob)
    assert_bit_exact(parsed, adapter)

    rep = report(out, tag)
    logs = [json.loads((out / f"{tag}-collectives-{rank}.json").read_text()) for rank in range(4)]
    payload = [c for log in logs for c in log if c["op"] == "broadcast" and not c["world"]]
    sent = sum(c["sent"] for c in payload)  # measured at the torch.distributed call
    received = sum(c["received"] for c in payload)
    assert rep["payload_bytes"] == len(blob)
    assert sent == received == rep["bytes_sent"] == len(blob) * receivers
    assert sum(n["bytes_received"] for n in rep["nodes"]) == len(blob) * receivers
    # Non-leaders (other than src) receive only the 24-byte header.
    for rank in (1, 3):
        if rank != src:
            assert [c for c in logs[rank] if c["op"] != "all_gather"] == [
                {"op": "broadcast", "world": True, "size": 4, "nbytes": 24, "sent": 0, "received": 24}
            ]
    control = sum(c["sent"] for log in logs for c in log) - sent
    assert control < 8192, control  # header and per-node results JSON only
