"""The fleet's slot plan, pure: which versions stay on an engine with an adapter limit."""

from __future__ import annotations

import pytest

from lorasync.fleet._plan import SlotNeed, plan_slots
from lorasync.errors import CapacityError


def need(tenant, current, loaded=(), held=(), window=None):
    return SlotNeed(tenant, current, tuple(loaded), frozenset(held), frozenset(window if window is not None else loaded))


def test_current_versions_first_then_in_use_then_windows_newest_first():
    needs = [need("a", 5, loaded=(3, 4), window=(4, 5)), need("b", 9, loaded=(7, 8, 9), window=(8, 9)), need("c", 2, loaded=(1,), held=(1,))]
    # 5 slots: a@v5 (to load), b@v9, c@v2 (to load), c@v1 (in use) = 4; one window slot: the
    # newest-ranked of a@v4 and b@v8 (rank 0 each; a first by name); b@v8 and a@v3, b@v7 go.
    assert plan_slots(needs, capacity=5, foreign=[], where="e") == [("a", 3), ("b", 7), ("b", 8)]
    assert plan_slots(needs, capacity=6, foreign=[], where="e") == [("a", 3), ("b", 7)]


def test_one_tenants_window_never_evicts_anothers_current_or_in_use_version():
    # a keeps a wide window, b has one current version and one in use: a's window yields.
    needs = [need("a", 10, loaded=(7, 8, 9, 10), window=(7, 8, 9, 10)), need("b", 3, loaded=(2, 3), held=(2,))]
    drop = plan_slots(needs, capacity=3, foreign=[], where="e")
    assert drop == [("a", 7), ("a", 8), ("a", 9)]


def test_refused_when_current_and_in_use_versions_do_not_fit_naming_tenants_and_slots():
    needs = [need("a", 2, loaded=(1,)), need("b", 1, loaded=(1,), held=(1,)), need("c", 4, loaded=(4,))]
    with pytest.raises(CapacityError) as caught:
        plan_slots(needs, capacity=2, foreign=["other@v1"], where="peft at (in-process)")
    message = str(caught.value)
    assert "peft at (in-process) has 2 adapter slots, and the tenants need 4" in message
    assert "a@v2 (to load)" in message and "b@v1" in message and "c@v4" in message and "other@v1" in message
    assert "Nothing was unloaded" in message and caught.value.context["tenants"] == ("a", "b", "c")


def test_soft_budget_lets_in_use_versions_drain_beyond_it_but_not_current_ones():
    needs = [need("a", 2, loaded=(1,), held=(1,)), need("b", 1, loaded=(1,)), need("c", 1, loaded=(1,))]
    with pytest.raises(CapacityError):
        plan_slots(needs, capacity=3, foreign=[], where="e")
    assert plan_slots(needs, capacity=3, foreign=[], where="e", soft=True) == []
    with pytest.raises(CapacityError):
        plan_slots([*needs, need("d", 1)], capacity=3, foreign=[], where="e", soft=True)
