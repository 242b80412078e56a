"""DistributedFleet under real torch.distributed: 4 gloo ranks simulate 2 nodes with separate roots,
each node's leader with a PEFT engine of 3 slots; src (rank 0) trains three tenants. What every
served name serves is compared exactly with the trainer's tensors at its version, and its tokens
with PEFT's own forward (src's). One spawn runs the whole run (see _dist_fleet_worker.py)."""

from __future__ import annotations

import json

import pytest
import torch
from _dist_fleet_worker import run_fleet
from safetensors.torch import load_file

DEADLINE_S = 150


@pytest.fixture(scope="module")
def out(tmp_path_factory, spawn_ranks, tiny_model_dir):
    path = tmp_path_factory.mktemp("dist-fleet")
    took = spawn_ranks(run_fleet, (str(path), str(tiny_model_dir)), nprocs=4, out=path, deadline_s=DEADLINE_S)
    assert took < DEADLINE_S
    return path


def read(out, name):
    return json.loads((out / name).read_text())


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_serves(out, tag, node, served):
    tenant, version = served.split("@v")
    want = load_file(str(out / f"want-{tenant}-{version}.safetensors"))
    assert same(load_file(str(out / f"{tag}-node{node}-{served}.safetensors")), want), (tag, node, served)
    assert read(out, f"{tag}-node{node}-{served}.json") == read(out, f"want-{tenant}-{version}.json"), (tag, node, served)


def test_roles_and_every_call_on_every_rank(out):
    outcomes = [read(out, f"outcome-{r}.json") for r in range(4)]
    assert [o["is_leader"] for o in outcomes] == [True, False, True, False]
    for o in outcomes:  # the same outcome on every rank: no rank goes on alone
        assert {k: v.split(":")[0] for k, v in o.items() if k.startswith(("register", "retire", "unknown", "v", "only", "bad", "d", "restore", "second"))} == {
            "register-a": "ok", "register-b": "ok", "register-c": "ok", "v1": "ok", "v2": "ok", "v3": "ok", "only-b": "ok",
            "bad-probe": "ok", "register-d-full": "CapacityError", "unknown-tenant": "ConfigError", "retire-c": "ok", "register-d": "ok",
            "d": "ok", "restore": "ok", "second-register-a-still-served": "ConfigError", "second-register-a": "ok", "second": "ok",
        }  # fmt: skip
    assert "3 adapter slots" in outcomes[1]["register-d-full"] and "no tenant 'zz'" in outcomes[3]["unknown-tenant"]
    assert "still serves a@v3" in outcomes[3]["second-register-a-still-served"]


def test_three_tenants_step_on_both_nodes_with_exact_tensors_and_tokens(out):
    for version in (1, 2, 3):
        report = read(out, f"v{version}-report.json")
        assert report["ok"] and report["sent"] == ["a", "b", "c"]
        for tenant in "abc":
            assert report["tenants"][tenant] == {n: ["loaded", version, f"{tenant}@v{version}", [], ["loaded"]] for n in ("0", "1")}
        assert all(report["verified"][t] == {n: [version == 3] for n in ("0", "1")} for t in "abc")  # v3 went with probes
        for node in (0, 1):
            assert read(out, f"v{version}-node{node}-served.json") == [f"a@v{version}", f"b@v{version}", f"c@v{version}"]
            for tenant in "abc":
                assert_serves(out, f"v{version}", node, f"{tenant}@v{version}")


def test_only_what_stepped_crosses_the_network(out):
    report = read(out, "only-b-report.json")
    v3 = read(out, "v3-report.json")
    assert report["sent"] == ["b"] and 0 < report["bytes_sent"] < v3["bytes_sent"] / 2
    assert report["tenants"]["a"] == {n: ["unchanged", 3, "a@v3", [], []] for n in ("0", "1")}
    assert report["tenants"]["b"] == {n: ["loaded", 4, "b@v4", [], ["loaded"]] for n in ("0", "1")}
    for node in (0, 1):
        assert read(out, f"only-b-node{node}-served.json") == ["a@v3", "b@v4", "c@v3"]
        assert_serves(out, "only-b", node, "b@v4")


def test_retire_frees_slots_then_a_fourth_serves_and_a_lost_node_is_restored(out):
    for node in (0, 1):
        assert read(out, f"d-node{node}-served.json") == ["a@v3", "b@v4", "d@v1"]
        assert_serves(out, "d", node, "d@v1")
    restored = read(out, "restore-report.json")
    assert {n: r["1"][:2] for n, r in restored.items()} == {"a": ["restored", 3], "b": ["restored", 4], "d": ["restored", 1]}
    assert all("0" not in r for r in restored.values())  # node 0 lost nothing: nothing moved there
    assert read(out, "end-node1-served.json") == ["a@v3", "b@v4", "d@v1"]
    for served in ("a@v3", "b@v4", "d@v1"):
        tenant, version = served.split("@v")
        assert same(load_file(str(out / f"end-node1-{served}.safetensors")), load_file(str(out / f"want-{tenant}-{version}.safetensors")))


def test_a_tenant_failing_its_probe_fails_alone_on_every_node_and_comes_back(out):
    report = read(out, "bad-probe-report.json")
    assert report["sent"] == ["a", "c"] and not report["ok"]
    assert report["errors"]["a"] == {"0": "VerificationError", "1": "VerificationError"}
    assert {n: r[:2] for n, r in report["tenants"]["a"].items()} == {"0": ["failed", 3], "1": ["failed", 3]}
    assert report["tenants"]["c"] == {n: ["loaded", 5, "c@v5", [], ["loaded"]] for n in ("0", "1")}
    assert report["tenants"]["b"] == {n: ["unchanged", 4, "b@v4", [], []] for n in ("0", "1")}
    # Its slot went to c@v5 before its v5 failed: the next round restores a@v3 on both nodes.
    d = read(out, "d-report.json")
    assert {n: r[:2] for n, r in d["tenants"]["a"].items()} == {"0": ["restored", 3], "1": ["restored", 3]}
    for node in (0, 1):
        assert_serves(out, "d", node, "a@v3")


def test_a_second_run_registers_afresh_once_the_first_runs_versions_are_gone(out):
    report = read(out, "second-report.json")
    assert report["tenants"]["a"] == {n: ["loaded", 10, "a@v10", [], ["loaded"]] for n in ("0", "1")}
    for node in (0, 1):
        assert read(out, f"second-node{node}-served.json") == ["a@v10"]
        assert_serves(out, "second", node, "a@v10")
