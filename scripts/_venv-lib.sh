# Shared by engine-venv.sh, sglang-venv.sh and megatron-venv.sh (sourced, not run): progress
# lines with the elapsed time, pip without its noise (real errors kept), and the ready marker.
#
# A script sets `label`, `venv` and `py`, then calls: venv_cached CHECK (exits 0 when the venv is
# ready), venv_begin, step ..., pip_install ..., venv_ready SUMMARY.
# The marker (.ready, read by lorasync/testing/venvs.py) is written last and atomically: a venv
# without it is half-built, and is rebuilt here or reported by lorasync, never used.

_venv_start=$SECONDS
step() { echo "[$label $((SECONDS - _venv_start))s] $*" >&2; }

# venv_cached CHECK: a marked venv whose python runs CHECK is reused (prints its python, exits).
# CHECK should only look modules up (importlib.util.find_spec): importing vLLM or SGLang takes
# 10-30 s, and the test command re-checks all three venvs on every run.
venv_cached() {
  if [ -f "$venv/.ready" ]; then
    if "$py" -c "$1" >/dev/null 2>&1; then
      local size
      size="$(sed -n 's/^size=//p' "$venv/.ready" 2>/dev/null)"
      echo "[$label] ready (cached${size:+, $size}): $venv" >&2
      echo "$py"
      exit 0
    fi
    step "the venv at $venv is marked ready but its python fails this check: $1; rebuilding it"
  elif [ -e "$venv" ]; then
    step "found a half-built venv at $venv (no .ready marker: an earlier build stopped part-way); rebuilding it"
  fi
}

# pip_install ARGS...: `pip install -q ARGS`; a line of progress every minute while it runs.
# Dropped: pip's "is ignored: it is neither a file nor a directory" lines about local index
# folders, and its resolver's list of requirements that packages installed with --no-deps
# declare (the names in $no_deps_of, matched as "NAME VERSION requires X, which is not
# installed."): counted in one line instead. Anything else pip says stays; if pip fails, all of
# its output is shown and the script stops with pip's exit code.
pip_install() {
  local log rc=0 pid n=0
  log="$(mktemp)"
  "$py" -m pip install -q --progress-bar off "$@" >"$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    n=$((n + 1))
    if [ $((n % 60)) -eq 0 ]; then step "  ... still installing ($(du -sh "$venv" 2>/dev/null | cut -f1) so far)"; fi
  done
  wait "$pid" || rc=$?
  if [ "$rc" -ne 0 ]; then
    step "pip install $* failed (exit $rc); pip said:"
    grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
    rm -f "$log"
    exit "$rc"
  fi
  awk -v pkgs="${no_deps_of:-}" -v tag="[$label]" '
    BEGIN { n = split(pkgs, list, " "); for (i = 1; i <= n; i++) expected[tolower(list[i])] = 1 }
    /is ignored: it is neither a file nor a directory/ { next }
    /^ERROR: pip.s dependency resolver does not currently take into account/ { header = $0; next }
    $2 ~ /^[0-9]/ && $3 == "requires" && /, which is not installed\.$/ && (tolower($1) in expected) { left[$1]++; next }
    { if (header != "") { print header; header = "" } print }
    END { for (p in left) printf "%s %d optional requirements of %s left out on purpose (installed with --no-deps; `pip check` lists them)\n", tag, left[p], p }
  ' "$log" >&2
  rm -f "$log"
}

# python_at_least BASE MINOR WHY: stop, saying what to do, unless BASE is Python 3.MINOR or newer.
python_at_least() {
  if ! "$1" -c "import sys; sys.exit(sys.version_info < (3, $2))" 2>/dev/null; then
    echo "[$label] $1 is $("$1" --version 2>&1 || echo missing); $3 needs Python >= 3.$2: put a newer python3 first on PATH and run this again" >&2
    exit 1
  fi
}

# venv_begin: remove whatever is there (a half-built or broken venv) and create an empty one
# with BASE_PYTHON (default python3).
venv_begin() {
  step "building $venv"
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "${1:-python3}" -m venv "$venv"
  pip_install --upgrade pip
}

# venv_ready SUMMARY: the last step: record what was built and its size in the marker, atomically.
venv_ready() {
  local size
  size="$(du -sh "$venv" | cut -f1)"
  printf 'built=%s\nsize=%s\nwhat=%s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$size" "$1" >"$venv/.ready.tmp"
  mv -f "$venv/.ready.tmp" "$venv/.ready"
  step "ready: $1; $size at $venv"
  echo "$py"
}

# check_imports CODE: run CODE with the venv's python and print its stdout (the versions line).
# What the imports say on stderr (SGLang's "Only CUDA ... support AWQ", Megatron's "Transformer
# Engine and Apex are not installed", torch's "No CUDA runtime is found") is expected on a CPU box
# and is shown only when the check fails, with the exit code.
check_imports() {
  local err out rc=0
  err="$(mktemp)"
  out="$("$py" -c "$1" 2>"$err")" || rc=$?
  if [ "$rc" -ne 0 ]; then
    step "the import check failed (exit $rc); python said:"
    cat "$err" >&2
    rm -f "$err"
    exit "$rc"
  fi
  rm -f "$err"
  echo "$out"
}

# pinned_by PACKAGE NAME...: each NAME, as PACKAGE's own `NAME==V` requirement where it declares
# one (markers evaluated for this python), else the bare NAME. For packages installed with
# --no-deps whose helpers are then installed by hand: pip would otherwise pick the newest helper
# and print "PACKAGE requires X==V, but you have X W which is incompatible".
pinned_by() {
  "$py" - "$@" <<'PY'
import importlib.metadata as md, re, sys
try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv has packaging only inside pip
    from pip._vendor.packaging.requirements import Requirement
pkg, names = sys.argv[1], sys.argv[2:]
pins = {}
for text in md.requires(pkg) or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    exact = [s.version for s in req.specifier if s.operator == "=="]
    if exact:
        pins[re.sub(r"[-_.]+", "-", req.name).lower()] = exact[0]
for name in names:
    key = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[ ]", name, maxsplit=1)[0]).lower()
    print(f"{key}=={pins[key]}" if key in pins and name == key else name)
PY
}

# spec_check MODULE...: python code that exits 1 when any MODULE cannot be found (found, not
# imported: a dotted name imports its parent packages, so give top-level names where those are heavy).
spec_check() {
  local names=""
  for m in "$@"; do names+="\"$m\", "; done
  echo "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ($names)))"
}
