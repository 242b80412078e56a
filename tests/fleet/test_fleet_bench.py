"""``lorasync bench fleet`` runs on a tiny shape: the Fleet sends one adapter per round whatever
the number of tenants, whether all are passed or only the changed one, and reports its goal for
both. No timing assertions."""

from __future__ import annotations

import json

from benchmarks._harness import Options
from benchmarks.fleet import run


def test_fleet_bench_sends_one_adapter_per_round_for_any_number_of_tenants(tmp_path):
    report = run(Options(quick=True, out=tmp_path, repeats=1, warmup=0, shapes=["tiny"], ranks=[4], engines=[1, 3], root=tmp_path, progress=False, plot=False))
    report.write(tmp_path, plot=False)
    data = json.loads((tmp_path / "fleet.json").read_text())
    timings = data["data"]["timings"] if "data" in data else data["timings"]
    one = timings["1"]["fleet_bytes"]
    assert one > 0 and timings["3"]["fleet_bytes"] == one == timings["3"]["publishers_bytes"] == timings["3"]["fleet_changed_only_bytes"]
    assert [g.name for g in report.goals] == ["Fleet: 3 tenants / 1, one changed, all 3 passed", "Fleet: 3 tenants / 1, one changed, only it passed"]
