#!/usr/bin/env bash
# Create .venv with lorasync and what its demo, recipes and benchmarks need (torch, peft,
# transformers, TRL, ...). With --test (scripts/test.sh and scripts/test-fast.sh pass it) also the
# test extras: pytest, DeepSpeed, Ray, ... Those stay out of a user's setup: DeepSpeed, once
# installed, prints "Setting accelerator to CPU" whenever transformers is imported on a machine
# without a GPU, in every script of the user's.
# Idempotent: a second run only re-installs lorasync itself (and adds the test extras for --test).
#   bash scripts/bootstrap.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
USER_EXTRAS="trl,bench"
TEST_EXTRAS="trl,bench,test"
extras="$USER_EXTRAS"
case "${1:-}" in
  "") ;;
  --test) extras="$TEST_EXTRAS" ;;
  *) echo "usage: bash scripts/bootstrap.sh [--test]   (--test: also the test extras, for scripts/test.sh)" >&2; exit 2 ;;
esac
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# pip's "is ignored: it is neither a file nor a directory" lines (local index folders) and the
# notice setuptools prints on every editable install ("BuildBackendWarning: Editable
# installation. ... Please be careful with folders in your working directory ...", about nine
# lines between "!!" markers, then the source line it points at) are dropped; the rest is shown.
quiet() {
  "$@" 2>&1 | awk '
    /is ignored: it is neither a file nor a directory/ { next }
    /BuildBackendWarning: Editable installation\./ { skip = 1; bangs = 0; n = 0; next }
    skip { n++; if ($1 == "!!") bangs++; if (bangs == 2 || n > 12) { skip = 0; after = 1 } next }
    after { after = 0; if ($0 ~ /^[[:space:]]+with strategy, WheelFile\(/) next }
    { print }
  ' || { rc=$?; echo "[bootstrap] failed (exit $rc): $*" >&2; exit "$rc"; }
}
# One line per step on stderr, with the elapsed time: a fresh machine takes a few minutes.
start=$SECONDS
step() { echo "[bootstrap $((SECONDS - start))s] $*" >&2; }
step "1/4 pip in .venv"
quiet .venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned to 2.13.0 (what the engine venvs use): pip takes the CPU wheel where the
# index has one (this project's CI keeps it on local disk); anything looser pulls CUDA builds.
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  # Sizes measured: the CPU wheel (from an index that has it, e.g. https://download.pytorch.org/whl/cpu)
  # is a 190 MB download and 750 MB installed; PyPI's Linux wheel is the CUDA build: about 4.6 GB
  # installed with its nvidia-* libraries and triton.
  step "2/4 torch 2.13.0 (CPU wheel: 190 MB download, 750 MB installed; PyPI's CUDA build on Linux: about 4.6 GB)"
  quiet .venv/bin/python -m pip install -q "torch==2.13.0"
else
  step "2/4 torch 2.13.0 already installed"
fi
if [ "$extras" = "$TEST_EXTRAS" ]; then
  step "3/4 lorasync (editable) with the TRL, bench and test extras: peft, transformers, TRL, deepspeed, pytest, ray..."
else
  step "3/4 lorasync (editable) with the TRL and bench extras: peft, transformers, TRL, accelerate, datasets..."
fi
quiet .venv/bin/python -m pip install -q -e ".[$extras]" "torch==2.13.0"
step "4/4 checking the environment"
.venv/bin/python -m pip check >/dev/null 2>&1 || { echo "[bootstrap] pip check reports conflicts:" >&2; .venv/bin/python -m pip check >&2 || true; }
.venv/bin/python -c "import lorasync, torch, peft, transformers; print('lorasync', lorasync.__version__, 'torch', torch.__version__, 'peft', peft.__version__)"
step "done: $(du -sh .venv | cut -f1) in .venv"
