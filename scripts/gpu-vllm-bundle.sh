#!/usr/bin/env bash
# Bring vLLM to a GPU machine that has no package registry (this workplace's H200 image: Python
# 3.12, torch 2.11.0+cu130, transformers 5.17, no vLLM). Never run by CI.
#
#   scripts/gpu-vllm-bundle.sh build  [DIR]          # CPU side: download, prune, pack, split; print the plan
#   scripts/gpu-vllm-bundle.sh stage  DIR REPO       # CPU side: copy each chunk into REPO/.gpu-bN/ (carry paths)
#   scripts/gpu-vllm-bundle.sh take   CHUNKDIR [DIR] # device side, every call: move a carried chunk to DIR
#   scripts/gpu-vllm-bundle.sh install [DIR] [SITE]  # device side, once: reassemble, pip install --target SITE
#   scripts/gpu-vllm-bundle.sh check  [SITE]         # import what the GPU tests import (CPU or device)
#
# DIR defaults to /tmp/lorasync-vllm-bundle, SITE to /tmp/site; then `export PYTHONPATH=SITE`.
#
# What it brings and why (docs/benchmarks-gpu.md, "real vLLM on the H200"):
# * vLLM 0.26.0: the newest release that pins torch==2.11.0, the image's torch (0.28/0.30 pin
#   2.13.0, 0.33 pins 2.14.0). Its native libraries link libcudart.so.13 and torch's stable ABI.
# * Installed with --no-deps: its full closure is ~125 packages / 3.4 GB, mostly CUDA 12 libraries
#   of optional kernel packages (flashinfer, cutlass-dsl, tokenspeed, ...) that serving a bf16
#   model with LoRA never imports. DEPS below is what the OpenAI server, vllm.LLM and vllm.lora
#   import that the image lacks, found by importing them against an emulation of the image
#   (Python 3.12, torch 2.11.0 cu130 wheel, transformers 5.17.0, tokenizers 0.23.2) until clean.
# * Pruned from the 290 MB wheel: the FlashAttention-2 library (Hopper runs FlashAttention-3,
#   FA2 is only the fallback for other GPUs: 129 MB packed), the Rust frontend binary (only with
#   VLLM_USE_RUST_FRONTEND=1), vendored DeepGEMM (FP8 only) and the Blackwell FMHA sources.
# * Packed as one xz stream of *stored* (uncompressed) wheels: xz shrinks shared libraries far
#   more than the wheels' deflate does. Split into chunks that each fit one device call (a call
#   carries 64 MiB with the working tree).
set -euo pipefail

VLLM_VERSION="${LORASYNC_GPU_VLLM:-0.26.0}"
CHUNK_MB="${LORASYNC_GPU_CHUNK_MB:-44}"  # a call carries 64 MiB with the working tree (5.7 MiB at 2026-12-05)


PRUNE=(
  "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"
  "vllm/vllm-rs"
  "vllm/third_party/deep_gemm/"
  "vllm/third_party/fmha_sm100/"
)
here="$(cd "$(dirname "$0")" && pwd)"
deps_file="$here/gpu-vllm-deps.txt"
cmd="${1:-}"
shift || true

die() { echo "gpu-vllm-bundle: $*" >&2; exit 1; }

read_deps() {
  DEPS=("vllm==$VLLM_VERSION")
  while read -r line; do
    line="${line%%#*}"
    line="$(echo "$line" | tr -d '[:space:]')"
    [ -n "$line" ] && DEPS+=("$line")
  done <"$deps_file"
}

case "$cmd" in
build)
  dir="${1:-/tmp/lorasync-vllm-bundle}"
  read_deps
  mkdir -p "$dir/dl" "$dir/stored"
  rm -f "$dir"/stored/*.whl "$dir"/chunk.*
  echo "[bundle] downloading ${#DEPS[@]} wheels (cp312, manylinux x86_64, --no-deps) into $dir/dl" >&2
  # One platform list for every wheel; pip matches manylinux_2_N exactly, so several are named.
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
    -d "$dir/dl" "${DEPS[@]}" 2>&1 | grep -v "is ignored" >&2 || true
  for spec in "${DEPS[@]}"; do
    name="${spec%%==*}"
    norm="$(echo "$name" | tr 'A-Z-.' 'a-z__')"
    ls "$dir"/dl/*.whl | grep -qi "/${norm}-" || ls "$dir"/dl/*.whl | grep -qi "/${name}-" || die "no wheel for $spec"
  done
  echo "[bundle] repacking as stored wheels, pruning vLLM" >&2
  python3 - "$dir" "${PRUNE[@]}" <<'PY'
import base64, csv, hashlib, io, pathlib, sys, zipfile
out = pathlib.Path(sys.argv[1]); prune = sys.argv[2:]
for whl in sorted((out / "dl").glob("*.whl")):
    dst = out / "stored" / whl.name
    dropped = 0
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
        names = [i for i in src.infolist() if not any(i.filename == p or (p.endswith("/") and i.filename.startswith(p)) for p in prune)]
        dropped = len(src.infolist()) - len(names)
        record = next((i.filename for i in names if i.filename.endswith(".dist-info/RECORD")), None)
        kept = {i.filename for i in names}
        for info in names:
            data = src.read(info.filename)
            if info.filename == record and dropped:  # RECORD lists only what ships
                rows = [r for r in csv.reader(io.StringIO(data.decode())) if r and r[0] in kept]
                buf = io.StringIO(); csv.writer(buf, lineterminator="\n").writerows(rows); data = buf.getvalue().encode()
            zi = zipfile.ZipInfo(info.filename, info.date_time); zi.external_attr = info.external_attr
            z.writestr(zi, data)
    if dropped:
        print(f"[bundle] {whl.name}: pruned {dropped} files", file=sys.stderr)
PY
  echo "[bundle] xz -9 (multi-threaded)" >&2
  (cd "$dir/stored" && tar -cf - *.whl) | xz -9 -T0 -c >"$dir/bundle.tar.xz"
  # As few chunks as CHUNK_MB allows, of equal size (each leaves room for the tree and the code).
  bytes=$(stat -c %s "$dir/bundle.tar.xz")
  n=$(((bytes + CHUNK_MB * 1048576 - 1) / (CHUNK_MB * 1048576)))
  (cd "$dir" && sha256sum bundle.tar.xz >bundle.sha256 && split -n "$n" -d -a 1 bundle.tar.xz chunk.)
  echo "== wheels (downloaded size, MB)"
  du -m "$dir"/dl/*.whl | sort -rn | awk '{printf "  %5d  %s\n", $1, $2}' | sed "s#$dir/dl/##"
  echo "== total downloaded: $(du -cm "$dir"/dl/*.whl | tail -1 | cut -f1) MB; stored (pruned, unpacked): $(du -cm "$dir"/stored/*.whl | tail -1 | cut -f1) MB; xz: $(du -m "$dir/bundle.tar.xz" | cut -f1) MB"
  echo "== chunk plan: one device call per chunk, back to back (chunk 1 with the code, the last with the install)"
  n=0
  for c in "$dir"/chunk.*; do
    n=$((n + 1))
    printf "  call %d: %s %5d MB -> carry .gpu-b%d\n" "$n" "$(basename "$c")" "$(du -m "$c" | cut -f1)" "$n"
  done
  ;;
stage)
  dir="${1:?bundle dir}"
  repo="${2:?repository root (an ignored folder per chunk is made there)}"
  n=0
  for c in "$dir"/chunk.*; do
    n=$((n + 1))
    rm -rf "$repo/.gpu-b$n"
    mkdir -p "$repo/.gpu-b$n"
    cp "$c" "$repo/.gpu-b$n/"
  done
  cp "$dir/bundle.sha256" "$repo/.gpu-b1/"
  echo "$n chunks staged in $repo/.gpu-b1..$n" >&2
  ;;
take)
  src="${1:?carried chunk folder}"
  dir="${2:-/tmp/lorasync-vllm-bundle}"
  mkdir -p "$dir"
  mv "$src"/* "$dir"/
  ls -la "$dir"
  ;;
install)
  dir="${1:-/tmp/lorasync-vllm-bundle}"
  site="${2:-/tmp/site}"
  (cd "$dir" && cat chunk.* >bundle.tar.xz && sha256sum -c bundle.sha256) || die "chunks missing or corrupt in $dir"
  mkdir -p "$dir/wheels"
  xz -d -T0 -c "$dir/bundle.tar.xz" | tar -xf - -C "$dir/wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$dir"/wheels/*.whl
  rm -rf "$site/bin"  # console scripts: vLLM is started with python3 -m
  echo "installed $(ls "$dir"/wheels/*.whl | wc -l) wheels into $site; export PYTHONPATH=$site" >&2
  ;;
check)
  site="${1:-/tmp/site}"
  PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 - <<'PY'
import importlib, sys
mods = ["vllm", "vllm.entrypoints.openai.api_server", "vllm.lora.request", "vllm.lora.peft_helper",
        "vllm.lora.utils", "vllm.lora.lora_model", "vllm.lora.worker_manager", "vllm.lora.model_manager",
        "vllm.v1.engine.async_llm", "vllm.model_executor.models.qwen3", "vllm.model_executor.models.qwen3_moe"]
bad = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as exc:  # report every failure, not only the first
        bad.append(f"{m}: {type(exc).__name__}: {exc}")
from vllm import LLM, SamplingParams  # noqa: F401
import vllm
print("vllm", vllm.__version__, "from", vllm.__file__)
if bad:
    sys.exit("imports failed:\n  " + "\n  ".join(bad))
print("imports clean:", len(mods))
PY
  ;;
*)
  sed -n 2,12p "$0" >&2
  exit 2
  ;;
esac
