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
# One line per step on stderr, with the elapsed time: a fresh machine takes a few minutes.
start=$SECONDS
step() { echo "[bootstrap $((SECONDS - start))s] $*" >&2; }
step "1/4 pip in .venv"
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
# torch first and pinned: 2.13.0 is the CPU wheel on local disk; anything looser pulls CUDA builds.
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  step "2/4 torch 2.13.0 (CPU, about 200 MB)"
  quiet .venv/bin/python -m pip install -q "torch==2.13.0"
else
  step "2/4 torch 2.13.0 already installed"
fi
step "3/4 lorasync (editable) with the test and bench extras: peft, transformers, TRL, deepspeed, pytest..."
quiet .venv/bin/python -m pip install -q -e ".[test,bench]" "torch==2.13.0"
step "4/4 checking the environment"
.venv/bin/python -m pip check >/dev/null 2>&1 || { echo "[bootstrap] pip check reports conflicts:" >&2; .venv/bin/python -m pip check >&2 || true; }
.venv/bin/python -c "import lorasync, torch, peft, transformers; print('lorasync', lorasync.__version__, 'torch', torch.__version__, 'peft', peft.__version__)"
step "done: $(du -sh .venv | cut -f1) in .venv"
