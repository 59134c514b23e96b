#!/usr/bin/env bash
# Issue 28 on the H200 in one device call, from the repository root:
#
#   HICACHE_COMMIT=<hash> bash tools/device_io.sh      # carry [".whl", ".sglang_src", ".devdata"]
#
# Steps (STEPS picks; default all):
#   tests     pytest -m gpu on the copy engines (tests/test_io*.py) and the CUDA cache state machine
#   overhead  bench-overhead on CUDA, the shared trace (.devdata/synthetic_trace.jsonl), DeepSeek-V3.2
#             layout, OVERHEAD_LIMIT requests (default 1500) -> $DEST/overhead-h200.json
#   io        bench-io (IO_ARGS adds flags) -> $DEST/io-h200.json
#   sglang    tools/io_vs_sglang.py: SGLang 0.5.23's HiCache kernels, built from the sources in
#             .sglang_src (extracted from its wheel) with apache-tvm-ffi from .whl -> $DEST/io-vs-sglang-h200.json
# DEST is $OUT when set (the device machine), else bench/results; each log starts with the
# commit, the machine and the command. Exit status: the first failing step's.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEST=${OUT:-bench/results}
STEPS=${STEPS:-tests overhead io sglang}
COMMIT=${HICACHE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export HICACHE_COMMIT=$COMMIT
mkdir -p "$DEST"
rc=0
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() { echo; echo "=== $* ($(date +%T))"; }
keep() { [ "$rc" -eq 0 ] && rc=$1; return 0; }
header() { echo "# commit $COMMIT; machine $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(nproc) cpus; command: $*"; }

nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv || true

if want tests; then
  step "GPU tests"
  cmd="$PY -m pytest -m gpu tests/test_io_engine.py tests/test_io_plans.py tests/test_io_issue.py tests/test_cache_stateful.py -q -p no:cacheprovider -rs -o faulthandler_timeout=60"
  { header "$cmd"; timeout "${TESTS_TIMEOUT:-150}" $cmd 2>&1 | tail -30; } | tee "$DEST/io-gpu-tests.log"
  keep "${PIPESTATUS[0]}"
fi

if want overhead; then
  step "bench-overhead (CUDA)"
  cmd="$PY -m hicache_cp bench-overhead --trace .devdata/synthetic_trace.jsonl --device cuda --l2-fraction 0.1 --limit ${OVERHEAD_LIMIT:-1500} --json $DEST/overhead-h200.json"
  { header "$cmd"; timeout "${OVERHEAD_TIMEOUT:-90}" $cmd 2>&1; } | tee "$DEST/overhead-h200.log"
  keep "${PIPESTATUS[0]}"
fi

if want io; then
  step "bench-io"
  cmd="$PY -m hicache_cp bench-io --json $DEST/io-h200.json ${IO_ARGS:-}"
  { header "$cmd"; timeout "${IO_TIMEOUT:-240}" $cmd 2>&1; } | tee "$DEST/io-h200.log"
  keep "${PIPESTATUS[0]}"
fi

if want sglang; then
  step "SGLang's HiCache kernels against ours"
  if $PY -c "import tvm_ffi" 2>/dev/null || { $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/apache_tvm_ffi-*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site; }; then
    cmd="$PY tools/io_vs_sglang.py --sglang-src .sglang_src --json $DEST/io-vs-sglang-h200.json ${SGLANG_ARGS:-}"
    { header "$cmd"; timeout "${SGLANG_TIMEOUT:-200}" $cmd 2>&1; } | tee "$DEST/io-vs-sglang-h200.log"
    keep "${PIPESTATUS[0]}"
  else
    echo "apache-tvm-ffi missing (carry .whl)"; keep 1
  fi
fi
exit "$rc"
