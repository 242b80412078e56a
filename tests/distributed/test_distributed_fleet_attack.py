"""DistributedFleet when src's caller passes something that is not an adapter (2 gloo ranks):
the tenant fails alone with a typed error in src's report, and both ranks stay in step (the
next publish is the same call on both). Before, src raised an AttributeError alone, before the
round's broadcast, and rank 1 took src's next call for this one."""

from __future__ import annotations

import json

from _dist_fleet_attack_worker import run_not_an_adapter

DEADLINE_S = 90


def test_not_an_adapter_fails_its_tenant_alone_and_the_ranks_stay_in_step(tmp_path, spawn_ranks):
    spawn_ranks(run_not_an_adapter, (str(tmp_path),), nprocs=2, out=tmp_path, deadline_s=DEADLINE_S)
    src, other = (json.loads((tmp_path / f"outcome-{rank}.json").read_text()) for rank in range(2))
    assert src["typo"]["raised"] is None and src["typo"]["report"] == {"a": ["failed", "ConfigError"], "b": ["loaded", None]}
    assert other["typo"] == {"raised": None, "report": None, "seconds": other["typo"]["seconds"]}
    assert src["next"]["report"] == {"a": ["loaded", None]} and other["next"]["raised"] is None
    assert all(o[tag]["seconds"] < 10 for o in (src, other) for tag in ("typo", "next"))
    assert src["served"] == ["a@v1", "b@v1"]


def test_a_leader_that_cannot_decode_a_tenant_fails_it_there_alone_and_stays_in_step(tmp_path, spawn_ranks):
    """Before, the leader raised out of publish, skipping the reports' gather src waited in."""
    from _dist_fleet_attack_worker import run_undecodable

    spawn_ranks(run_undecodable, (str(tmp_path),), nprocs=2, out=tmp_path, deadline_s=DEADLINE_S)
    src, other = (json.loads((tmp_path / f"outcome-{rank}.json").read_text()) for rank in range(2))
    first = src["first"]["report"]
    assert src["first"]["raised"] is None and other["first"]["raised"] is None
    assert sorted(first.items()) == [("a/0", ["loaded", None]), ("a/1", ["failed", "TransportError"]), ("b/0", ["loaded", None]), ("b/1", ["loaded", None])]
    assert src["next"]["raised"] is None and other["next"]["raised"] is None
    # a crosses again (node 1 never got it) and loads there; what every node serves stays put.
    assert src["next"]["report"] == {"a/0": ["unchanged", None], "a/1": ["loaded", None], "b/0": ["unchanged", None], "b/1": ["unchanged", None]}
    assert src["served"] == ["a@v1", "b@v1"] and other["served"] == ["a@v2", "b@v1"]
    assert all(o[tag]["seconds"] < 15 for o in (src, other) for tag in ("first", "next"))


def test_an_unchanged_tenant_given_a_probe_is_unchanged_only_once_the_probe_passes(tmp_path, spawn_ranks, tiny_model_dir):
    """Issue 33's "unchanged needs a pass with a probe", as the plain Fleet does: a tenant whose
    content did not change but comes with a probe is verified on every node. Before, src skipped it
    by its remembered hash and every node reported it "unchanged" without running the probe."""
    from _dist_fleet_attack_worker import run_unchanged_with_probe

    spawn_ranks(run_unchanged_with_probe, (str(tmp_path), str(tiny_model_dir)), nprocs=2, out=tmp_path, deadline_s=DEADLINE_S)
    src, other = (json.loads((tmp_path / f"outcome-{rank}.json").read_text()) for rank in range(2))
    assert src["first"] == {"0": ["loaded", 1, None], "1": ["loaded", 1, None]}
    assert src["bad"] == {"0": ["failed", 1, "VerificationError"], "1": ["failed", 1, "VerificationError"]}
    assert src["good"] == {"0": ["unchanged", 1, None], "1": ["unchanged", 1, None]}
    for outcome in (src, other):
        assert outcome["first-served"] == outcome["bad-served"] == outcome["good-served"] == ["a@v1"]  # v1 serves throughout
