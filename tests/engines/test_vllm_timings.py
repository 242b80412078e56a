"""The worker's timing of its adds (engines/vllm/_timings.py) is a diagnostic: whatever its
profiling switch says, and whatever goes wrong with a profile, vLLM's add runs and answers as
it would without it (each case was a failing repro of an outside attack)."""

from __future__ import annotations

import cProfile
import types
from pathlib import Path

import pytest

from lorasync.engines.vllm import _timings
from lorasync.engines.vllm._protocol import IPC_PREFIX


class _Manager:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.adds = fail, 0

    def add_adapter(self, request: object) -> bool:
        self.adds += 1
        if self.fail:
            raise RuntimeError("vLLM refused the adapter")
        return True


def _request(i: int) -> object:
    return types.SimpleNamespace(lora_name=f"policy@v{i}", lora_path=f"{IPC_PREFIX}tok{i}", lora_int_id=i + 1)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_timings._PROFILE, "left", None)  # the switch is read again
    monkeypatch.setattr(_timings, "_TIMES", type(_timings._TIMES)(maxlen=64))


@pytest.mark.parametrize("value", ["\u00b2:/tmp/p", "-1:/tmp/p", "2", "x:/tmp/p", "", ":"])
def test_a_switch_it_cannot_read_profiles_nothing_and_every_add_runs(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("LORASYNC_PROFILE_ADDS", value)
    manager = _Manager()
    _timings.time_adds(manager, IPC_PREFIX)
    for i in range(3):
        _timings.record_build(f"policy@v{i}", 0.0, 0.001)
        assert manager.add_adapter(_request(i)) is True
    assert manager.adds == 3
    assert all(t["add_s"] is not None for t in _timings.load_timings())


def test_a_profile_that_cannot_be_written_never_fails_the_add(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("LORASYNC_PROFILE_ADDS", f"1:{tmp_path / 'missing' / 'profile'}")
    manager = _Manager()
    _timings.time_adds(manager, IPC_PREFIX)
    assert manager.add_adapter(_request(0)) is True and manager.add_adapter(_request(1)) is True
    assert "cannot write the profile" in caplog.text


@pytest.mark.parametrize(
    "refusal",
    [
        ValueError("Another profiling tool is already active"),  # Python 3.12+: a second active profiler
        RuntimeError("sys.setprofile refused by an audit hook"),  # Python 3.11 and earlier raise its audit event
    ],
    ids=["another-profiler", "audit-hook"],
)
def test_a_profiler_that_cannot_start_never_fails_the_add(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture, refusal: Exception) -> None:
    """The add runs unprofiled, and profiling stops."""
    monkeypatch.setenv("LORASYNC_PROFILE_ADDS", f"2:{tmp_path / 'profile'}")

    def refuse(self: cProfile.Profile) -> None:
        raise refusal

    monkeypatch.setattr(cProfile.Profile, "enable", refuse)
    manager = _Manager()
    _timings.time_adds(manager, IPC_PREFIX)
    assert manager.add_adapter(_request(0)) is True and manager.add_adapter(_request(1)) is True
    assert manager.adds == 2 and "cannot profile" in caplog.text and not list(tmp_path.iterdir())


def test_the_profile_is_written_after_n_adds_and_an_add_error_is_the_adds_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORASYNC_PROFILE_ADDS", f"2:{tmp_path / 'profile'}")
    manager = _Manager(fail=True)
    _timings.time_adds(manager, IPC_PREFIX)
    for i in range(2):
        _timings.record_build(f"policy@v{i}", 0.0, 0.001)
        with pytest.raises(RuntimeError, match="vLLM refused"):
            manager.add_adapter(_request(i))
    written = list(tmp_path.iterdir())
    assert len(written) == 1 and "add_adapter" in written[0].read_text()
    assert [t["add_s"] is not None for t in _timings.load_timings()] == [True, True]


def test_a_count_too_long_for_int_profiles_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORASYNC_PROFILE_ADDS", "9" * 5000 + ":/tmp/p")
    manager = _Manager()
    _timings.time_adds(manager, IPC_PREFIX)
    assert manager.add_adapter(_request(0)) is True and manager.add_adapter(_request(1)) is True

