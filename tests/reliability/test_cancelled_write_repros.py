"""The outside attack on the cancelled-write fix (2026-12-06), each repro kept as it was written
(``tests/reliability/repros/cancelled_write/``) and run in a process of its own (some fill
lorasync's shared thread pool, or cut ``ABANDONED_WRITE_WAIT_S``). Each exits non-zero on the
bug it was written for:

* ``never_started_job``, ``stress_never_started``: a write cancelled while still queued in the
  pool never ran, so it never ended, and every later publish and close waited 5 s for it;
* ``close_then_late_write_retakes_run``: a write ending after close took the closed run again;
* ``retry_adopts_then_late_undo_removes``: a retry adopted the late write's version, which that
  write then removed under the engine;
* ``head_loop_blocks_on_job_lock``: the event loop waited on a lock a thread held over a removal;
* ``head_kept_stale_version`` (``newcontent``, ``cancelagain``): a version kept for a retry that
  then failed or was cancelled stayed in the run, unserved, or blocked the retry for good;
* ``fleet_retire_after_cancelled_round``: a Fleet retirement removed the run while a cancelled
  round's write went on, which made the run's folder again;
* ``enospc_abandoned``: an abandoned write that fails on a full disk leaves nothing.

And from the second attack (on the redesign):

* ``sync_close_skips_settle``, ``sync_close_exit_leaves_tmp``: a sync ``close()`` after
  ``asyncio.run(...apublish...)`` did not wait for the cancelled write, which died at exit and
  left its temp folder;
* ``function_api_retry_adopts_then_removed``: the function API's throwaway publishers shared the
  run but not the version's lock, so a retry adopted a version the cancelled call then removed;
* ``stuck_write_taxes_every_publish``: one write stuck past the bound cost every later publish
  and close the whole bound again;
* ``retry_new_content_after_cancel_in_load``, ``retry_new_content_after_cancel_unchanged``: a
  publish cancelled after its write (during the load, or the "unchanged" re-list) left the
  version's files, and the retry with the trainer's newer tensors failed as "immutable".
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "repros" / "cancelled_write"
ROOT = Path(__file__).resolve().parents[2]

CASES = [
    ("never_started_job", {}),
    ("stress_never_started", {}),
    ("close_then_late_write_retakes_run", {}),
    ("retry_adopts_then_late_undo_removes", {}),
    ("head_loop_blocks_on_job_lock", {}),
    ("head_kept_stale_version", {"MODE": "newcontent"}),
    ("head_kept_stale_version", {"MODE": "cancelagain"}),
    ("fleet_retire_after_cancelled_round", {}),
    ("enospc_abandoned", {}),
    ("sync_close_skips_settle", {}),
    ("sync_close_exit_leaves_tmp", {}),
    ("function_api_retry_adopts_then_removed", {}),
    ("stuck_write_taxes_every_publish", {}),
    ("retry_new_content_after_cancel_in_load", {}),
    ("retry_new_content_after_cancel_unchanged", {}),
]


@pytest.mark.parametrize(("script", "env"), CASES, ids=[f"{s}{'-' + e['MODE'] if e else ''}" for s, e in CASES])
def test_repro_holds(script: str, env: dict[str, str], tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(HERE / f"{script}.py")],
        env={**os.environ, **env, "REPRO_ROOT": str(tmp_path), "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"{script} {env}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
