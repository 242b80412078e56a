"""A publishing process SIGKILLed at random moments never leaves a partial version visible under a
published name; its temp files are swept by the next publish; the engine (which reads every
version it loads) only ever sees complete versions and serves one after the next publish."""

from __future__ import annotations

import sys

import pytest

from ._figures import record
from ._harness import run_crash_soak

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork + SIGKILL soak")


def test_sigkill_mid_publish_leaves_nothing_torn():
    result = run_crash_soak(kills=40, seed=0)
    record(kills=result["kills"], kills_garbage=result["kills_leaving_garbage"], torn=result["torn"])
    assert result["violations"] == [], "\n".join(result["violations"][:20])
    assert result["recovered"] == 40 and result["torn"] == 0


@pytest.mark.slow
def test_sigkill_soak():
    result = run_crash_soak(kills=240, seed=1)
    record(kills=result["kills"], kills_garbage=result["kills_leaving_garbage"], torn=result["torn"])
    assert result["violations"] == [], "\n".join(result["violations"][:20])
