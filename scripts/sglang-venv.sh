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
# imports. torch and torchvision must be a matching pair (2.14.1 / 0.29.1); the CPU
# torch 2.13.0 with PyPI's torchvision fails to import.
set -euo pipefail
SGLANG_VERSION="${LORASYNC_SGLANG_VERSION:-0.5.23}"
TORCH_VERSION="${LORASYNC_SGLANG_TORCH:-2.14.1}"
TORCHVISION_VERSION="${LORASYNC_SGLANG_TORCHVISION:-0.29.1}"
cache="${LORASYNC_ENGINE_CACHE:-$HOME/.cache/lorasync}"
venv="$cache/sglang-$SGLANG_VERSION"
py="$venv/bin/python"
# What the contract server (tests/peers/sglang_contract.py) and lorasync itself import.
probe="import sglang.srt.entrypoints.http_server, sglang.srt.managers.io_struct, peft, safetensors, httpx, tenacity, uvicorn"

if [ -f "$venv/.ready" ] && "$py" -c "$probe" >/dev/null 2>&1; then
  echo "$py"
  exit 0
fi

echo "building SGLang venv at $venv" >&2
# pip warns about every local index folder it skips; keep real errors visible.
quiet() { "$@" 2>&1 | grep -v "is ignored: it is neither" >&2 || true; }
rm -rf "$venv"
mkdir -p "$cache"
python3 -m venv "$venv"
quiet "$py" -m pip install -q --upgrade pip
quiet "$py" -m pip install -q "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
quiet "$py" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
# Import-time needs of sglang.srt.entrypoints.http_server, plus what lorasync and its
# contract server import (httpx, tenacity, safetensors, peft).
quiet "$py" -m pip install -q \
  "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" "transformers==5.19.0" \
  numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic \
  pyzmq tqdm ipython aiohttp dill apache-tvm-ffi sentencepiece compressed-tensors gguf openai \
  partial-json-parser uvicorn uvloop fastapi setproctitle einops jsonschema xgrammar soundfile \
  python-multipart httpx tenacity safetensors "peft>=0.15"
"$py" -c "$probe; import sglang; print('sglang', sglang.__version__)" >&2
touch "$venv/.ready"
echo "$py"
