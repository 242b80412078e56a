#!/usr/bin/env bash
# Create .venv with lorasync and everything its tests, demo and benchmarks need.
# Idempotent: a second run only re-installs lorasync itself.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
quiet() { "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
# torch first and pinned: 2.13.0 is the CPU wheel on local disk; anything looser pulls CUDA builds.
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  quiet .venv/bin/python -m pip install -q "torch==2.13.0"
fi
quiet .venv/bin/python -m pip install -q -e ".[test,bench]" "torch==2.13.0"
.venv/bin/python -c "import lorasync, torch, peft, transformers; print('lorasync', lorasync.__version__, 'torch', torch.__version__, 'peft', peft.__version__)"
