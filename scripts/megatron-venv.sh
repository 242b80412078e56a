#!/usr/bin/env bash
# Build (or reuse) a Python 3.12 venv with the real Megatron-Core + Megatron-Bridge, the peer the
# Megatron exporter's real-peer tests (tests/megatron/peers/) run against. Cached outside the repo
# like the engine venvs; prints the venv's python path on its last line.
#
#   scripts/megatron-venv.sh            # build or reuse
#   LORASYNC_ENGINE_CACHE=/path scripts/megatron-venv.sh
#
# Facts this relies on: megatron-core >= 0.17 requires Python >= 3.12 (pyenv's 3.12 is used when
# there is no python3.12 on PATH); Megatron-Bridge's own dependency list pulls GPU-only and
# logging packages (flashinfer, wandb, mlflow, ...) that the LoRA code never imports, so it is
# installed with --no-deps and only what `megatron.bridge.peft` and `AutoBridge` import is added;
# Megatron-Bridge pins transformers <= 5.12.1. torch for cp312 comes from PyPI (its CUDA wheel
# also runs on CPU).
set -euo pipefail
MCORE_VERSION="${LORASYNC_MCORE_VERSION:-0.19.2}"
BRIDGE_VERSION="${LORASYNC_BRIDGE_VERSION:-0.6.2}"
TORCH_VERSION="${LORASYNC_MEGATRON_TORCH:-2.13.0}"
cache="${LORASYNC_ENGINE_CACHE:-$HOME/.cache/lorasync}"
venv="$cache/megatron-$MCORE_VERSION-bridge-$BRIDGE_VERSION"
py="$venv/bin/python"
label="megatron-venv"
no_deps_of="megatron-bridge"  # installed with --no-deps: pip's resolver lists what it declares
source "$(dirname "$0")/_venv-lib.sh"

# `import megatron.bridge` itself needs transformer_engine, which the tests stand in for
# (tests/megatron/peers/cpu_standins.py), so only its presence is checked.
venv_cached "$(spec_check megatron.core megatron.bridge transformers peft torch)"

base=""
for candidate in python3.12 "$HOME/.pyenv/versions/3.12"*/bin/python3.12; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    base="$candidate"
    break
  fi
done
if [ -z "$base" ]; then
  echo "[$label] no Python 3.12 found (megatron-core >= 0.17 needs it): put python3.12 on PATH (or install it with pyenv) and run this again" >&2
  exit 1
fi

venv_begin "$base"
step "1/4 torch $TORCH_VERSION for Python 3.12 (from PyPI: the CUDA build, about 4.6 GB with its nvidia-* libraries and triton; it runs on CPU too)"
pip_install "torch==$TORCH_VERSION"
step "2/4 megatron-core $MCORE_VERSION"
pip_install "megatron-core==$MCORE_VERSION" "torch==$TORCH_VERSION"
step "3/4 megatron-bridge $BRIDGE_VERSION (no deps) and what its LoRA and conversion code imports"
pip_install --no-deps "megatron-bridge==$BRIDGE_VERSION"
# What megatron.bridge's model conversion and PEFT modules import (not its training extras).
pip_install "torch==$TORCH_VERSION" "transformers>=5.8,<=5.12.1" "peft>=0.18.1" accelerate einops omegaconf \
  "hydra-core>=1.3.4,<1.4" pyyaml tqdm rich regex six safetensors tenacity typing-extensions
step "4/4 checking the imports"
versions="$(check_imports "import importlib.util, megatron.core, transformers, peft, torch; assert importlib.util.find_spec('megatron.bridge'); print('megatron-core', megatron.core.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'torch', torch.__version__)")"
venv_ready "Megatron venv, Python 3.12 ($versions)"
