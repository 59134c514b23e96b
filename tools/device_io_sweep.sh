#!/usr/bin/env bash
# Copy-kernel experiments and the final copy-engine numbers on the H200 (issue 13),
# from the repository root, one device call per STEPS set:
#
#   HICACHE_COMMIT=<hash> STEPS=sweep bash tools/device_io_sweep.sh        # experiments -> $DEST/io-sweep.json
#   HICACHE_COMMIT=<hash> STEPS="io tests" bash tools/device_io_sweep.sh   # bench-io -> $DEST/io-h200.json, GPU tests
#
# Steps:
#   sweep   tools/io_sweep.py: kernel grid cap x unroll x tail, contiguous vs scattered,
#           fixed cost per copy, copies without per-copy events, kernel+DMA split
#   tests   pytest -m gpu tests/ (the copy engines, their kernel shapes, the cache on CUDA engines)
#   io      hicache-cp bench-io with the default flags (IO_ARGS adds more)
# DEST is $OUT when set (the device machine), else bench/results; every log starts
# with the commit, the machine and the command. Exit status: the first failing step's.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEST=${OUT:-bench/results}
STEPS=${STEPS:-sweep}
COMMIT=${HICACHE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export HICACHE_COMMIT=$COMMIT
mkdir -p "$DEST"
rc=0
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() { echo; echo "=== $* ($(date +%T))"; }
keep() { [ "$rc" -eq 0 ] && rc=$1; return 0; }
header() { echo "# commit $COMMIT; machine $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(nproc) cpus; command: $*"; }

nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv || true

if want sweep; then
  step "io sweep"
  cmd="$PY tools/io_sweep.py --json $DEST/io-sweep.json ${SWEEP_ARGS:-}"
  { header "$cmd"; timeout "${SWEEP_TIMEOUT:-220}" $cmd 2>&1; } | tee "$DEST/io-sweep.log"
  keep "${PIPESTATUS[0]}"
fi

if want io; then
  step "bench-io"
  cmd="$PY -m hicache_cp bench-io --json $DEST/io-h200.json ${IO_ARGS:-}"
  { header "$cmd"; timeout "${IO_TIMEOUT:-170}" $cmd 2>&1; } | tee "$DEST/io-bench.log"
  keep "${PIPESTATUS[0]}"
fi
if want tests; then
  step "GPU io tests"
  cmd="$PY -m pytest -m gpu tests -q -p no:cacheprovider -rs --durations=5 -o faulthandler_timeout=60"
  { header "$cmd"; timeout "${TESTS_TIMEOUT:-100}" $cmd 2>&1; } | tee "$DEST/io-gpu-tests.log"
  keep "${PIPESTATUS[0]}"
fi

exit "$rc"
