"""A live Adapter updated in place and published again is published and served, never reported
"unchanged" on a stale hash (scenario in _stale.py; real peer: the in-process PEFT engine)."""

from __future__ import annotations

from pathlib import Path

from ._figures import record
from ._stale import TRANSPORTS, run_stale_unchanged


def test_in_place_updates_are_published_and_served(tiny_model_dir: Path) -> None:
    result = run_stale_unchanged(tiny_model_dir, steps=3)
    record(stale=result["cases"], stale_served=result["cases"] - len(result["violations"]))
    assert result["cases"] == 3 * len(TRANSPORTS)
    assert result["violations"] == []
