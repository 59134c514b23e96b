#!/usr/bin/env bash
# The copy engines on a CUDA machine (the H200), in one call, from the repository root:
#   HICACHE_COMMIT=$(git rev-parse --short HEAD) STEPS="tests io overhead" bash tools/gpu_io_check.sh
# Steps (STEPS picks; default all three):
#   tests     pytest -m gpu: the copy-engine tests and the cache state machine on CUDA engines
#   io        bench-io -> $DEST/io-h200.json
#   overhead  bench-overhead on CUDA over $TRACE (default .devdata/synthetic_trace.jsonl: copy
#             ../shared/traces/synthetic_trace.jsonl there and carry .devdata) -> $DEST/overhead-h200.json;
#             OVERHEAD_LIMIT caps the requests (default: the whole trace)
# DEST is $OUT when set (the device machine), else bench/results; logs go beside the JSON.
# HICACHE_COMMIT names the commit in every JSON (the device copy has no .git).
# Exit status: the first failing step's.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEST=${OUT:-bench/results}
TRACE=${TRACE:-.devdata/synthetic_trace.jsonl}
STEPS=${STEPS:-tests io overhead}
mkdir -p "$DEST"
rc=0
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() { echo; echo "=== $* ($(date +%T))"; }
keep() { [ "$rc" -eq 0 ] && rc=$1; return 0; }

nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv || true

if want tests; then
  step "GPU tests"
  timeout "${TESTS_TIMEOUT:-110}" $PY -m pytest -m gpu tests/test_io_engine.py tests/test_cache_stateful.py \
    -q -p no:cacheprovider -rs --durations=6 -o faulthandler_timeout=60 2>&1 | tee "$DEST/io-gpu-tests.log"
  keep "${PIPESTATUS[0]}"
fi

if want io; then
  step "bench-io"
  timeout "${IO_TIMEOUT:-120}" $PY -m hicache_cp.harness.bench.io --json "$DEST/io-h200.json" ${IO_ARGS:-} 2>&1 \
    | tee "$DEST/io-bench.log"
  keep "${PIPESTATUS[0]}"
fi

if want overhead; then
  step "bench-overhead (CUDA)"
  if [ -f "$TRACE" ]; then
    timeout "${OVERHEAD_TIMEOUT:-90}" $PY -m hicache_cp.harness.bench.overhead --trace "$TRACE" --device cuda \
      --l2-fraction 0.1 ${OVERHEAD_LIMIT:+--limit $OVERHEAD_LIMIT} --json "$DEST/overhead-h200.json" 2>&1 \
      | tee "$DEST/overhead-bench.log"
    keep "${PIPESTATUS[0]}"
  else
    echo "no trace at $TRACE: skipped"
  fi
fi
exit "$rc"
