#!/usr/bin/env bash
# Run on a CUDA machine (the H200) from the repository root:
#   the GPU copy-engine tests, then bench-io writing bench/results/io-h200.json
#   (or $OUT/io-h200.json when OUT is set, as on the device machine).
# Exit status: the tests' if they fail, else bench-io's.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEST=${OUT:-bench/results}
mkdir -p "$DEST"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv || true
$PY -m pytest -m gpu tests/test_io_engine.py -q --maxfail=20 -p no:cacheprovider --noconftest 2>&1 | tee "$DEST/io-gpu-tests.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
  echo "gpu tests failed (rc=$rc); running bench-io anyway" >&2
fi
$PY -m hicache_cp.harness.bench.io --json "$DEST/io-h200.json" "$@" 2>&1 | tee "$DEST/io-bench.log"
brc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && exit "$rc"
exit "$brc"
