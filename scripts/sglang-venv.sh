#!/usr/bin/env bash
# Build (or reuse) a virtual environment holding SGLang's HTTP layer, outside the repo, so the
# SGLang tests can run SGLang's own FastAPI routes and request classes (no model is served:
# SGLang has no CPU kernels). Prints the venv's python path on its last line.
#
#   scripts/sglang-venv.sh            # build or reuse
#   LORASYNC_ENGINE_CACHE=/path scripts/sglang-venv.sh
#
# Facts this relies on (see docs/engines/sglang.md): `sglang` is installed with --no-deps (its
# full dependency set is GPU kernels), followed by what `sglang.srt.entrypoints.http_server`
# imports. torch and torchvision must be a matching pair (2.14.1 / 0.29.1): sglang's HTTP layer
# imports torchvision (sglang/srt/multimodal/internvl_utils.py), and PyPI's torchvision only
# loads next to its own CUDA torch ("operator torchvision::nms does not exist" with the local
# CPU torch 2.13.0+cpu; no CPU torchvision is on local disk). That pair pulls about 3.2 GB of
# nvidia-* libraries a CPU box never loads (6.1 GB venv). With a CPU torchvision on the index,
# LORASYNC_SGLANG_TORCH=2.13.0 LORASYNC_SGLANG_TORCHVISION=<its version> avoids them.
#
# SGLang main (its streamed-adapter protocol, PR #36384) is served by the same venv: the contract
# peer's --lora-protocol streamed mode runs 0.5.23's app with main's routes and rules as recorded
# in tests/peers/sglang_main_facts.json. There is no SGLang main venv: no release after 0.5.23 is
# on PyPI, and neither CI (package registries only) nor a developer machine can get main's source.
set -euo pipefail
SGLANG_VERSION="${LORASYNC_SGLANG_VERSION:-0.5.23}"
TORCH_VERSION="${LORASYNC_SGLANG_TORCH:-2.14.1}"
TORCHVISION_VERSION="${LORASYNC_SGLANG_TORCHVISION:-0.29.1}"
cache="${LORASYNC_ENGINE_CACHE:-$HOME/.cache/lorasync}"
venv="$cache/sglang-$SGLANG_VERSION"
py="$venv/bin/python"
label="sglang-venv"
no_deps_of="sglang"  # installed with --no-deps: pip's resolver lists its GPU dependencies
source "$(dirname "$0")/_venv-lib.sh"
# What the contract server (tests/peers/sglang_contract.py) and lorasync itself import.
probe="import sglang.srt.entrypoints.http_server, sglang.srt.managers.io_struct, peft, safetensors, httpx, tenacity, uvicorn"

# Top-level names only: finding sglang.srt.* imports sglang.srt's packages (about 12 s).
venv_cached "$(spec_check sglang peft safetensors httpx tenacity uvicorn)"

python_at_least python3 11 "sglang $SGLANG_VERSION"
venv_begin python3
torch_pins=("torch==$TORCH_VERSION")
if [ -n "$TORCHVISION_VERSION" ]; then torch_pins+=("torchvision==$TORCHVISION_VERSION"); fi
step "1/4 ${torch_pins[*]} (from PyPI: the CUDA builds, about 3.2 GB of nvidia-* libraries; see this script's header)"
pip_install "${torch_pins[@]}"
step "2/4 sglang $SGLANG_VERSION (no deps)"
pip_install --no-deps "sglang==$SGLANG_VERSION"
step "3/4 what sglang's HTTP layer and lorasync import (a few minutes)"
# Import-time needs of sglang.srt.entrypoints.http_server, plus what lorasync and its
# contract server import (httpx, tenacity, safetensors, peft).
# Each at sglang's own pin where it declares one (pinned_by), so pip has nothing to object to.
helpers=(numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic
  pyzmq tqdm ipython aiohttp dill apache-tvm-ffi sentencepiece compressed-tensors gguf openai
  partial-json-parser uvicorn uvloop fastapi setproctitle einops jsonschema xgrammar soundfile
  python-multipart httpx tenacity safetensors tokenizers)
mapfile -t helpers < <(pinned_by sglang "${helpers[@]}")
pip_install "${torch_pins[@]}" "transformers==5.19.0" "${helpers[@]}" "peft>=0.15"
step "4/4 checking the imports"
versions="$(check_imports "$probe; import sglang; print('sglang', sglang.__version__)")"
venv_ready "SGLang venv ($versions)"
