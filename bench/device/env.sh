# Sourced by the bench/device/*.sh scripts (never run on its own): what every GPU run
# shares. After `source bench/device/env.sh` from the repository root:
#
#   PY       the Python to run (PYTHON, else python3)
#   DEST     where results go: OUT if set, else bench/results
#   COMMIT   the commit every JSON and log names (HICACHE_COMMIT, else git; a copy of the
#            tree without .git must set HICACHE_COMMIT), exported as HICACHE_COMMIT
#   GPU      the tag result files are named with: the GPU's model (h100, h200, ...), "gpu"
#            for a model without one, "cpu" without nvidia-smi; GPU=... overrides it
#   STEPS    the steps to run (the script sets DEFAULT_STEPS before sourcing)
#   want S   true when step S is in STEPS;  step TEXT  a section heading with the time
#   keep RC  remember the first failing status in rc (the script exits "$rc")
#   header CMD   the provenance line a log starts with: commit, machine, command
#   wheels GLOB  pip-install local wheels (e.g. .whl/*.whl, not committed) into /tmp/site
#                (no index, no deps) and put it on PYTHONPATH, for hosts without network;
#                WHEELS=0 skips it (the packages are installed already, or a CPU rehearsal)
#   run NAME TIMEOUT CMD...  one step's command under a timeout, its log (header first) in
#                $DEST/NAME.log, its status kept
#   gpu_info     the GPU, its driver and its PCIe link
PY=${PYTHON:-python3}
DEST=${OUT:-bench/results}
COMMIT=${HICACHE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ -z "${GPU:-}" ]; then
  if command -v nvidia-smi >/dev/null; then
    GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oE '\b[A-Z][0-9]{2,3}[A-Z]?\b' | head -1 | tr 'A-Z' 'a-z')
    GPU=${GPU:-gpu}
  else
    GPU=cpu
  fi
fi
STEPS=${STEPS:-${DEFAULT_STEPS:-}}
export HICACHE_COMMIT=$COMMIT PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$DEST"
# The compiled CPU hashes (setup.py) are ignored by git, so a device copy lacks them: built
# in place (no network needed), else the library hashes with numpy (the same bits).
ls hicache_cp/_hashes*.so >/dev/null 2>&1 || $PY setup.py -q build_ext --inplace >/dev/null 2>&1 ||
  echo "note: hicache_cp._hashes not built here: CPU hashes in numpy" >&2
rc=0
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() { echo; echo "=== $* ($(date +%T))"; }
keep() { [ "$rc" -eq 0 ] && rc=$1; return 0; }
header() {
  echo "# commit $COMMIT; machine $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | xargs), $(nproc) cpus; command: $*"
}
wheels() {
  [ "${WHEELS:-1}" = 1 ] || return 0
  # shellcheck disable=SC2068 - the glob expands here
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $@ || return 1
  export PYTHONPATH=$PYTHONPATH:/tmp/site
}
run() {
  local name=$1 limit=$2
  shift 2
  { header "$*"; timeout "$limit" "$@" 2>&1; } | tee "$DEST/$name.log"
  keep "${PIPESTATUS[0]}"
}
gpu_info() {
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv || true
}
