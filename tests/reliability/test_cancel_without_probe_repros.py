"""The fourth outside attack of 2026-12-07 on cancelled publishes (``repros/cancel_without_probe/``),
each repro kept as it was handed over and run in a process of its own; each exits 1 on its bug:

* ``gather_two_engines_in_place``: with two engines, the cancel reached the caller when the first
  engine's swap ended, while the second's still ran; it later clobbered the next, ok, publish
  (``lorasync.runtime._loop.gather_all`` now waits for every engine);
* ``lease_multi_engine_stray``: one engine recorded the cancelled version and another's load,
  left running, served the trainer's next step under its name; ``lease()`` handed it out;
* ``in_place_probe_cancel_lease``: in place, a cancelled probed publish was taken out, but
  ``lease()`` still accepted its version;
* ``merged_recorded_lease_refused``: a landed, recorded merge was refused by ``lease()``;
* ``fleet_cancelled_restore_lease``: a cancelled Fleet restore (of files, exact) made the
  tenant's current version unleasable for good.
And from a fifth pass:
* ``cancel_held_forever_by_stuck_swap``: an engine call that never returned held the cancel, the
  next publish and ``aclose()`` for ever (``finish(bound=)``; the bound counts once);
* ``lease_after_cancelled_redo``: a cancel in the second round (engines "unchanged" loaded again
  under the new name) escaped the lease refusal;
* ``engine_cancelled_future_untyped``: an engine whose own loop dropped its call (a
  ``CancelledError`` the caller never asked for) cancelled the whole publish, untyped.
And from a sixth, on that bound:
* ``merged_rest_of_merge_lands_after_next_ok``: a merge left running past the bound started more
  calls than the cancel had seen; the next publish merged beside it and its ok was overwritten
  (the next publish now waits for the whole delivery, bounded: ``CancelledCalls.left_running``);
* ``merged_late_merge_reported_unchanged``, ``inplace_late_swap_reported_unchanged``: a merge or
  swap landing after the bound was never noticed, and a publish of the previous content was
  reported "unchanged" (what serves is unknown from there: ``_interrupted.left_running``).
And from the 11:55 session's fourth attack:
* ``lease_after_early_cancel``: a publish cancelled before any engine was touched (exporting,
  waiting for the lock) left ``lease()`` naming ``policy@v2``, served by no engine, or in place
  ``policy``, serving v1 (the whole publish now notes a cancel: ``Session._cancel_noted``).
And from the attack on that fix (15:14 session):
* ``unchanged_aftercare_cancel``, ``unchanged_republish_cancel``: an "unchanged" version, served
  under an earlier name, whose ok report stood was refused by ``lease()`` after a later cancel
  (a version with an ok report stays leased as the report says).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "repros" / "cancel_without_probe"
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", sorted(p.name for p in HERE.glob("*.py") if not p.name.startswith("_")))
def test_repro_holds(script: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, str(HERE / script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{script} shows its bug again:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
