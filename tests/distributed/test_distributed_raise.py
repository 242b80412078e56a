"""``on_error="raise"`` under real torch.distributed (2 gloo ranks, one node each): an engine that
fails on node 1 makes every rank raise the same typed error at that publish, at once, and the
next publish goes on normally. Before, only ``src`` could raise (``report.raise_for_errors()``),
and the other rank waited in the next publish's broadcast until the group's timeout.

The distributed path of ``LoraSyncCallback`` (process zero tells every rank) uses the same
``agree_on_error``; see tests/integrations/test_trl.py."""

from __future__ import annotations

import json

import pytest
from _dist_publish_worker import run_raise

DEADLINE_S = 90
GROUP_TIMEOUT_S = 30  # run_raise's group timeout: a rank left waiting would take this long


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, spawn_ranks):
    path = tmp_path_factory.mktemp("raise")
    spawn_ranks(run_raise, (str(path),), nprocs=2, out=path, deadline_s=DEADLINE_S)
    return [json.loads((path / f"raise-outcome-{rank}.json").read_text()) for rank in range(2)]


def _without_time(outcome):
    return {k: v for k, v in outcome.items() if k != "seconds"}


def test_an_engine_failure_raises_the_same_typed_error_on_every_rank(outcomes):
    src, other = (dict((tag, _without_time(o)) for tag, o in outcome.items()) for outcome in outcomes)
    assert src["v1"] == {"raised": None, "report": True, "served": ["policy@v1"]}
    assert other["v1"] == {"raised": None, "report": None, "served": ["policy@v1"]}
    # v2 failed on rank 1's engine: both ranks raise EngineUnavailableError with its message.
    for outcome in outcomes:
        assert outcome["v2"]["seconds"] < GROUP_TIMEOUT_S / 2, "a rank waited for the group's timeout"
        assert outcome["v2"]["raised"] == "EngineUnavailableError", outcome["v2"]
        assert outcome["v2"]["message"] == "engine down"
        assert outcome["v2"]["context"]["url"] == "memory://node1-e0"
    assert other["v2"]["context"]["rank"] == 0  # rebuilt from src's broadcast
    # Node 0 loaded v2; node 1 keeps serving v1.
    assert (src["v2"]["served"], other["v2"]["served"]) == (["policy@v2"], ["policy@v1"])
    # Nobody was left behind: the next publish works on both.
    assert src["v3"] == {"raised": None, "report": True, "served": ["policy@v3"]}
    assert other["v3"] == {"raised": None, "report": None, "served": ["policy@v3"]}

