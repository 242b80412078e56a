"""DistributedPublisher over NCCL: two ranks on two GPUs of one host, each its own node with its
own root and MemoryEngine, src's adapter on its GPU. gloo (the other tests) keeps every buffer in
host memory; this is the path where they all live on GPUs. Skips without two CUDA devices."""

from __future__ import annotations

import json

import pytest
import torch
from _dist_publish_worker import make_adapter, run_nccl
from safetensors.torch import load_file

from lorasync.distributed import encode_adapter

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available(),
    reason="needs two CUDA devices and NCCL",
)

DEADLINE_S = 120
STEPS = (("v1", 1, 1, torch.float32), ("v2", 2, 2, torch.bfloat16))


@pytest.fixture(scope="module")
def out(tmp_path_factory, spawn_ranks):
    path = tmp_path_factory.mktemp("nccl")
    spawn_ranks(run_nccl, (str(path),), nprocs=2, out=path, deadline_s=DEADLINE_S)
    return path


def _json(path):
    return json.loads(path.read_text())


def test_each_node_leads_itself(out):
    for rank in (0, 1):
        outcome = _json(out / f"outcome-{rank}.json")
        assert outcome["is_leader"] and outcome["leaders"] == {"0": 0, "1": 1}


@pytest.mark.parametrize("tag,version,seed,dtype", STEPS)
def test_both_nodes_serve_the_gpu_adapter_bit_for_bit(out, tag, version, seed, dtype):
    rep = _json(out / f"{tag}-report.json")
    assert rep["ok"] and rep["served_name"] == f"policy@v{version}"
    expected = make_adapter(seed, dtype)
    for node in (0, 1):
        got = load_file(str(out / f"{tag}-node{node}-0-policy@v{version}.safetensors"))
        assert sorted(got) == sorted(expected.tensors)
        for key, tensor in expected.tensors.items():
            assert got[key].dtype == tensor.dtype and torch.equal(got[key].view(torch.uint8), tensor.view(torch.uint8)), key
    # One adapter crossed NCCL, to the one receiving node, measured at the torch.distributed call.
    blob = encode_adapter(expected).numel()
    payload = [c for rank in (0, 1) for c in _json(out / f"{tag}-collectives-{rank}.json") if c["op"] == "broadcast" and not c["world"]]
    assert sum(c["sent"] for c in payload) == sum(c["received"] for c in payload) == rep["bytes_sent"] == blob


def test_unchanged_content_is_not_loaded_again(out):
    rep = _json(out / "v3-unchanged-report.json")
    assert rep["ok"] and {r["status"] for r in rep["results"]} == {"unchanged"}
    assert rep["served_name"] == "policy@v2" and rep["bytes_moved"] == 0
