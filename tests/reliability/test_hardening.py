"""Issue 15 hardening, the items needing no model: engine-listed names lorasync did not write are
foreign (left alone, never misread), former untyped errors are typed, and a directory rewritten
under its reader fails typed instead of killing the process."""

from __future__ import annotations

from ._figures import record
from ._hardening import run_foreign_names, run_untyped, run_vanishing


def test_foreign_served_names_are_left_alone_and_never_misread():
    result = run_foreign_names()
    record(foreign_names=result["tried"], foreign_names_left=result["handled"])
    assert result["violations"] == [], "\n".join(result["violations"])
    assert result["handled"] == result["tried"] >= 10


def test_formerly_untyped_inputs_are_refused_typed():
    result = run_untyped()
    record(untyped=result["tried"], untyped_typed=result["handled"])
    assert result["violations"] == [], "\n".join(result["violations"])
    assert result["handled"] == result["tried"] > 30


def test_a_directory_rewritten_under_its_reader_fails_typed():
    result = run_vanishing()
    record(vanish_loads=result["loads"], vanish_typed=result["handled"])
    assert result["violations"] == [], "\n".join(result["violations"])
    assert result["handled"] == result["tried"] > 50


def test_the_peft_engine_serves_the_file_or_refuses_it_and_never_touches_the_base():
    from ._hardening_peft import run_peft_configs

    result = run_peft_configs()
    record(peft_configs=result["tried"], peft_configs_safe=result["handled"])
    assert result["violations"] == [], "\n".join(result["violations"])
    assert result["handled"] == result["tried"] >= 30


def test_cancelling_a_merged_publish_at_any_await_point_releases_the_engine():
    from ._hardening_cancel import run_merged_cancellation

    result = run_merged_cancellation()
    record(cancel_points=result["tried"], cancel_released=result["handled"])
    assert result["violations"] == [], "\n".join(result["violations"])
    assert result["handled"] == result["tried"] >= 10


def test_a_trickling_peer_cannot_stretch_timeout():
    from ._hardening_http import run_trickle

    result = run_trickle()
    record(trickle_calls=result["tried"], trickle_bounded=result["handled"], trickle_longest_s=str(result["longest"]))
    assert result["violations"] == [], "\n".join(result["violations"])
    assert result["handled"] == result["tried"] == 8


def test_secrets_are_cleaned_or_refused_and_never_shown():
    from ._hardening_http import run_secrets

    result = run_secrets()
    record(secret_cases=result["tried"], secret_clean=result["handled"])
    assert result["violations"] == [], "\n".join(result["violations"])
    assert result["handled"] == result["tried"] > 20


def test_the_probe_states_its_power_and_strict_mode_catches_a_stale_engine():
    from ._hardening_probe import run_probe_power

    result = run_probe_power()
    record(probe_cases=result["tried"], probe_blind_default=result["blind_default"], probe_strict_ok=result["handled"])
    assert result["violations"] == [], "\n".join(result["violations"])
    assert result["handled"] == result["tried"] == 6
    assert result["blind_default"] >= 1  # the finding itself: the default tolerance misses a 1 % step
