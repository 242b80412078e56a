#!/usr/bin/env bash
# The test command: set up both environments, then run the whole suite (real vLLM included).
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --test   # the library venv plus the test extras (pytest, deepspeed, ray, ...)
cache="${LORASYNC_ENGINE_CACHE:-$HOME/.cache/lorasync}"
echo "[test] engine venvs in $cache (built once, then reused: vLLM CPU 3.5 GB, SGLang 6.1 GB, Megatron 5.0 GB with Python 3.12; the builds take 5-11 min on a fresh 2-core machine, quiet to busy, the suite 18-37 min on two workers; docs/setup.md). Without them: bash scripts/test-fast.sh" >&2
# The vLLM CPU engine lives in its own venv, cached outside the repo and reused.
LORASYNC_VLLM_PYTHON="$(bash scripts/engine-venv.sh | tail -n 1)"
export LORASYNC_VLLM_PYTHON
# SGLang's own HTTP layer (CPU import only) for the SGLang contract peer. A failed build shows up
# as failing SGLang tests (LORASYNC_REQUIRE_SGLANG=1 in CI) instead of aborting here.
LORASYNC_SGLANG_PYTHON="$(bash scripts/sglang-venv.sh | tail -n 1)" || LORASYNC_SGLANG_PYTHON=""
export LORASYNC_SGLANG_PYTHON
# Real Megatron-Core + Megatron-Bridge (Python 3.12) for the Megatron exporter's real-peer suite;
# a failed build shows up as failing peer tests (LORASYNC_REQUIRE_MEGATRON=1 in CI).
LORASYNC_MEGATRON_PYTHON="$(bash scripts/megatron-venv.sh | tail -n 1)" || LORASYNC_MEGATRON_PYTHON=""
export LORASYNC_MEGATRON_PYTHON
# AIBrix's runtime sidecar (pip aibrix, ~210 MB, no torch) in front of the vLLM CPU server, for the
# AIBrix engine's tests; a failed build shows up as failing AIBrix tests (LORASYNC_REQUIRE_AIBRIX=1 in CI).
LORASYNC_AIBRIX_PYTHON="$(bash scripts/aibrix-venv.sh | tail -n 1)" || LORASYNC_AIBRIX_PYTHON=""
export LORASYNC_AIBRIX_PYTHON
set +e
# Two workers (pytest-xdist): most of the suite's time is vLLM starting, which keeps one core busy;
# tests/conftest.py keeps each file on one worker and the Ray files together.
# A worker that dies (a crash in a test) ends the run, failed: xdist 3.8 replacing it under this
# scheduling waits forever. LORASYNC_TEST_WORKERS=0 runs everything in this one process;
# arguments after it override.
workers="${LORASYNC_TEST_WORKERS:-2}"
# A hung test fails after pytest-timeout's 600 s (pyproject.toml) with its stack. Anything it cannot
# see (a worker that never exits, a hang between tests) is interrupted once the run passes
# LORASYNC_SUITE_MINUTES (default 70, inside CI's 90): SIGINT makes pytest print what ran and
# where it stood, instead of a CI run that ends silently at its limit.
limit="${LORASYNC_SUITE_MINUTES:-70}"
timeout -s INT -k 120 "${limit}m" .venv/bin/python -m pytest -n "$workers" --dist loadgroup --max-worker-restart 0 "$@"
rc=$?
if [ "$rc" -eq 124 ]; then
  echo "[test] the suite ran past ${limit} min and was interrupted (LORASYNC_SUITE_MINUTES): see the tests still running above" >&2
fi
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
