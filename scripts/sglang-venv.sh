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
# pip warns about every local index folder it skips, and its resolver lists every GPU
# dependency of the --no-deps sglang as missing (expected here, and not an error); keep
# everything else visible.
quiet() {
  "$@" 2>&1 | grep -v -E "is ignored: it is neither|dependency resolver does not currently take into account|^sglang [0-9.]+ requires " >&2 || true
}
rm -rf "$venv"
mkdir -p "$cache"
python3 -m venv "$venv"
quiet "$py" -m pip install -q --upgrade pip
torch_pins=("torch==$TORCH_VERSION")
if [ -n "$TORCHVISION_VERSION" ]; then torch_pins+=("torchvision==$TORCHVISION_VERSION"); fi
step() { echo "[sglang-venv] $*" >&2; }
step "1/4 torch ${torch_pins[*]}"
quiet "$py" -m pip install -q "${torch_pins[@]}"
step "2/4 sglang $SGLANG_VERSION (no deps)"
quiet "$py" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
step "3/4 what sglang's HTTP layer and lorasync import (a few minutes)"
# Import-time needs of sglang.srt.entrypoints.http_server, plus what lorasync and its
# contract server import (httpx, tenacity, safetensors, peft).
quiet "$py" -m pip install -q \
  "${torch_pins[@]}" "transformers==5.19.0" \
  numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic \
  pyzmq tqdm ipython aiohttp dill apache-tvm-ffi sentencepiece compressed-tensors gguf openai \
  partial-json-parser uvicorn uvloop fastapi setproctitle einops jsonschema xgrammar soundfile \
  python-multipart httpx tenacity safetensors "peft>=0.15"
step "4/4 checking the imports"
"$py" -c "$probe; import sglang; print('sglang', sglang.__version__)" >&2
if ls "$venv"/lib/python*/site-packages | grep -q '^nvidia'; then
  echo "[sglang-venv] note: $(du -sch "$venv"/lib/python*/site-packages/nvidia* 2>/dev/null | tail -1 | cut -f1) of nvidia-* CUDA libraries came with torch $TORCH_VERSION (see this script's header)" >&2
fi
step "ready: $(du -sh "$venv" | cut -f1) at $venv"
touch "$venv/.ready"
echo "$py"
