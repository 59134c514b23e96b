#!/usr/bin/env bash
# The restore checks on the GPU (issue 44) in one device call, from the repository root:
#
#   HICACHE_COMMIT=<hash> bash bench/device/integrity.sh        # carry nothing; about 6 minutes
#
# Steps (STEPS picks; default "tests verify io"):
#   tests   pytest -m gpu: the checksum kernel equals numpy (device and pinned host memory), a
#           HiCache on the direct backend stores every backup's checksums, catches a flipped host
#           bit and a forward writing into loaded slots (ordered and racing), never deciding such a
#           load DONE (tests/test_checksum_gpu.py); the copy engines' and the CUDA cache's GPU
#           tests, whose submissions now go through the checked path (tests/test_io*.py,
#           tests/test_cache_stateful.py) -> $DEST/integrity-gpu-tests.log
#   verify  bench-verify without the replays: the kernel's GB/s against a contiguous pinned H2D
#           copy (target >= 20x) and a compute-bound forward alone and beside a load's checks
#           (target <= 1.01x) -> $DEST/verify-gpu.json
#   io      bench-io exposure rows of the default backend at 64 and 1024 pages with the checks
#           on and off, in that order on the same host -> $DEST/io-verify-all.json, io-verify-off.json
# Each log starts with the commit, the machine and the command. Exit status: the first failing step's.
set -uo pipefail
cd "$(dirname "$0")/../.."
DEFAULT_STEPS="tests verify io"
source bench/device/env.sh

gpu_info

if want tests; then
  step "GPU tests"
  run integrity-gpu-tests "${TESTS_TIMEOUT:-200}" $PY -m pytest -m gpu tests/test_checksum_gpu.py tests/test_io_engine.py \
    tests/test_io_plans.py tests/test_io_issue.py tests/test_cache_stateful.py -q -p no:cacheprovider -rs \
    -o faulthandler_timeout=90
fi
if want verify; then
  step "bench-verify (GPU parts)"
  run verify-gpu "${VERIFY_TIMEOUT:-120}" $PY -m hicache_harness bench-verify --skip-replay --json "$DEST/verify-gpu.json"
fi
if want io; then
  step "bench-io exposure, checks on then off"
  for mode in all off; do
    run "io-verify-$mode" "${IO_TIMEOUT:-150}" $PY -m hicache_harness bench-io --verify "$mode" --pages 1024 \
      --backends direct --runs-backends "" --kernel-sm-fractions "" --exposure-pages 64,1024 \
      --json "$DEST/io-verify-$mode.json"
  done
fi
exit "$rc"
