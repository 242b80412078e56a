#!/usr/bin/env bash
# Build (or reuse) a virtual environment holding AIBrix's runtime sidecar (pip `aibrix`, its
# `aibrix_runtime` process), outside the repo, so the AIBrix engine's tests run the real sidecar
# in front of a real vLLM CPU server. Prints the venv's python path on its last line.
#
#   scripts/aibrix-venv.sh            # build or reuse
#   LORASYNC_ENGINE_CACHE=/path scripts/aibrix-venv.sh
#
# The sidecar is a FastAPI app that only forwards to vLLM's HTTP routes: no torch, no vLLM (about
# 210 MB: its cloud-storage clients for artifact downloads). Its own venv because its pins
# (fastapi 0.112, starlette 0.38, httpx 0.27) differ from lorasync's and vLLM's.
set -euo pipefail
AIBRIX_VERSION="${LORASYNC_AIBRIX_VERSION:-0.8.0}"
cache="${LORASYNC_ENGINE_CACHE:-$HOME/.cache/lorasync}"
venv="$cache/aibrix-$AIBRIX_VERSION"
py="$venv/bin/python"
label="aibrix-venv"
source "$(dirname "$0")/_venv-lib.sh"
venv_cached "$(spec_check aibrix uvicorn fastapi)"

python_at_least python3 10 "aibrix $AIBRIX_VERSION"
venv_begin python3
step "1/2 aibrix $AIBRIX_VERSION"
pip_install "aibrix==$AIBRIX_VERSION"
step "2/2 checking the imports"
versions="$(check_imports "import aibrix.app, aibrix.__version__ as v; print('aibrix', v.__version__)")"
venv_ready "AIBrix runtime ($versions)"
