"""Cancellation at every await point of a publish, a real full disk, and a full engine: nothing is
left held or behind, and nothing is unloaded by a refused publish (see _publisher_hardening.py)."""

from __future__ import annotations

import pytest

from ._figures import record
from ._publisher_hardening import run_publisher_hardening


def test_publisher_releases_everything_and_refuses_before_unloading() -> None:
    outcome = run_publisher_hardening()
    record(publish_cancel_points=outcome["cancel_points"], disk_full=outcome["disk_full"], capacity_refusals=outcome["capacity"])
    assert outcome["violations"] == [], "\n".join(outcome["violations"])
    assert outcome["cancel_points"] >= 6 and outcome["capacity"] == 1
    if outcome["skipped"]:
        pytest.skip(f"disk-full scenario not run: {outcome['skipped']}")
    assert outcome["disk_full"] == 3
