"""16 publishers, each its own Publisher object, race versions of one name into shared engines:
every engine ends on the highest version, the max served version never goes down, no stale
version stays beside newer ones, and no served version loses its files."""

from __future__ import annotations

import pytest

from ._figures import record
from ._harness import run_race


@pytest.mark.parametrize("seed", [0, 1])
def test_racing_publishers_never_regress(seed):
    result = run_race(publishers=16, versions=48, keep=2, seed=seed)
    record(race=f"16 x {result['versions']}", races=1, regressions=result["regressions"])
    assert result["violations"] == [], "\n".join(result["violations"])
    assert result["regressions"] == 0
    assert all(h == sorted(h) for h in result["histories"].values()), result["histories"]
    # Only typed outcomes: loads, and versions that lost the race (superseded while loading).
    assert set(result["statuses"]) <= {"loaded", "unchanged", "StaleVersionError"}, result["statuses"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_racing_publishers_soak(seed):
    result = run_race(publishers=16, versions=400, keep=2, seed=100 + seed)
    record(race=f"16 x {result['versions']}", races=1, regressions=result["regressions"])
    assert result["violations"] == [], "\n".join(result["violations"][:20])
    assert set(result["statuses"]) <= {"loaded", "unchanged", "StaleVersionError"}, result["statuses"]
