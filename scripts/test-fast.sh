#!/usr/bin/env bash
# The fast part of the suite: everything that needs no engine venv and no vLLM server.
#   bash scripts/test-fast.sh [pytest args...]
# Builds no engine venv: the vLLM, SGLang and Megatron venvs are hidden (an empty
# LORASYNC_ENGINE_CACHE, their LORASYNC_*_PYTHON unset), so the tests that need one skip and say
# which script builds it; tests marked vllm, slow or gpu are deselected, and so are the folders
# and files below, whose tests start process groups (torch.distributed ranks, DeepSpeed ZeRO-3,
# a Ray cluster, crash and fault injection, every docs block): they are most of the suite's time.
# docs/setup.md has its time and how to run the rest (scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# A .venv from `bootstrap.sh` alone lacks the test extras (pytest-xdist among them).
if ! .venv/bin/python -c "import xdist, pytest_timeout, hypothesis" 2>/dev/null; then bash scripts/bootstrap.sh --test; fi
empty="$(mktemp -d)"
trap 'rm -rf "$empty"' EXIT
unset LORASYNC_VLLM_PYTHON LORASYNC_SGLANG_PYTHON LORASYNC_MEGATRON_PYTHON LORASYNC_AIBRIX_PYTHON
unset LORASYNC_REQUIRE_VLLM LORASYNC_REQUIRE_SGLANG LORASYNC_REQUIRE_MEGATRON LORASYNC_REQUIRE_AIBRIX
export LORASYNC_ENGINE_CACHE="$empty"
set +e
slow_parts=(
  tests/distributed tests/reliability tests/docs tests/exporters/test_deepspeed.py
  tests/engines/test_ray_engine.py tests/engines/test_ray_trust.py tests/megatron/test_megatron_distributed.py
)
# Two workers, as scripts/test.sh; LORASYNC_TEST_WORKERS=0 runs everything in this one process.
.venv/bin/python -m pytest -n "${LORASYNC_TEST_WORKERS:-2}" --dist loadgroup --max-worker-restart 0 -m "not vllm and not slow and not gpu" "${slow_parts[@]/#/--ignore=}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
