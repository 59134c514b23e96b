#!/usr/bin/env bash
# The copy engines on a GPU host, from the repository root:
#
#   STEPS="tests overhead io" bash bench/device/io.sh
#
# Steps (STEPS picks; default "tests overhead io sglang"); results are named with the GPU's tag
# ($GPU from bench/device/env.sh: h100, h200, ...):
#   tests     pytest -m gpu on the copy engines (tests/test_io*.py) and the CUDA cache state machine
#   overhead  bench-overhead on CUDA, a Mooncake-format trace (TRACE, default
#             .devdata/synthetic_trace.jsonl; not committed), DeepSeek-V3.2 layout, OVERHEAD_LIMIT
#             requests (default 1500) -> $DEST/overhead-$GPU.json; then each of OVERHEAD_VARIANTS
#             (bench-io's variant names) -> $DEST/overhead-$GPU-<variant>.json, on the same host;
#             OVERHEAD_ROUNDS=N (default 1) repeats the default and the variants in N interleaved
#             rounds, round r > 1 named overhead-$GPU-r<r>[-<variant>].json (the spread between
#             runs on one host)
#   floor     bench/scripts/host_floor.py replay: the same replay over the direct engine's Python
#             with a driver double, on this host's CPU (bench-overhead's time minus it is driver
#             time and waits) -> $DEST/host-floor-$GPU.json (FLOOR_ARGS adds flags)
#   profile   bench/experiments/profile_overhead.py: the same bench-overhead run under cProfile
#             (PROFILE_VARIANT picks a variant) -> $DEST/overhead-profile-$GPU.txt
#   io        bench-io (IO_ARGS adds flags) -> $DEST/io-$GPU.json
#   probe     bench/experiments/dma_probe.py: where the direct backend's exposure comes from
#             -> $DEST/dma-probe-$GPU.json
#   sweep     bench/experiments/io_sweep.py: the copy kernel's grid cap x unroll x tail
#             -> $DEST/io-sweep-$GPU.json
#   sglang    bench/scripts/io_vs_sglang.py: SGLang 0.5.23's HiCache kernels, built from the
#             sources in .sglang_src (extracted from its wheel), with apache-tvm-ffi installed or
#             its wheel in .whl/ -> $DEST/io-vs-sglang-$GPU.json
# Each log starts with the commit, the machine and the command. Exit status: the first failing step's.
set -uo pipefail
cd "$(dirname "$0")/../.."
DEFAULT_STEPS="tests overhead io sglang"
source bench/device/env.sh
TRACE=${TRACE:-.devdata/synthetic_trace.jsonl}

gpu_info

if want tests; then
  step "GPU tests"
  run io-gpu-tests "${TESTS_TIMEOUT:-150}" $PY -m pytest -m gpu tests/test_io_engine.py tests/test_io_plans.py \
    tests/test_io_issue.py tests/test_cache_stateful.py -q -p no:cacheprovider -rs -o faulthandler_timeout=60
fi
if want overhead; then
  step "bench-overhead (CUDA)"
  for r in $(seq 1 "${OVERHEAD_ROUNDS:-1}"); do
    name=overhead-$GPU$([ "$r" -gt 1 ] && echo "-r$r")
    run "$name" "${OVERHEAD_TIMEOUT:-90}" $PY -m hicache_harness bench-overhead --trace "$TRACE" \
      --device cuda --l2-fraction 0.1 --limit "${OVERHEAD_LIMIT:-1500}" --json "$DEST/$name.json"
    for v in ${OVERHEAD_VARIANTS:-}; do
      run "$name-$v" "${OVERHEAD_TIMEOUT:-90}" $PY -m hicache_harness bench-overhead --io-variant "$v" \
        --trace "$TRACE" --device cuda --l2-fraction 0.1 --limit "${OVERHEAD_LIMIT:-1500}" \
        --json "$DEST/$name-$v.json"
    done
  done
fi
if want floor; then
  step "the cache's Python floor on this host"
  # shellcheck disable=SC2086 - FLOOR_ARGS is a list of flags
  run host-floor-$GPU "${FLOOR_TIMEOUT:-150}" $PY bench/scripts/host_floor.py replay --runs 3 --trace "$TRACE" \
    --l2-fraction 0.1 --limit "${OVERHEAD_LIMIT:-1500}" --json "$DEST/host-floor-$GPU.json" ${FLOOR_ARGS:-}
fi
if want profile; then
  step "bench-overhead under cProfile"
  run overhead-profile-$GPU-run "${PROFILE_TIMEOUT:-120}" $PY bench/experiments/profile_overhead.py --out "$DEST/overhead-profile-$GPU.txt" -- \
    ${PROFILE_VARIANT:+--io-variant "$PROFILE_VARIANT"} --trace "$TRACE" --device cuda \
    --l2-fraction 0.1 --limit "${OVERHEAD_LIMIT:-1500}"
fi
if want io; then
  step "bench-io"
  # shellcheck disable=SC2086 - IO_ARGS is a list of flags
  run io-$GPU "${IO_TIMEOUT:-240}" $PY -m hicache_harness bench-io --json "$DEST/io-$GPU.json" ${IO_ARGS:-}
fi
if want probe; then
  step "DMA exposure probe"
  run dma-probe-$GPU "${PROBE_TIMEOUT:-200}" $PY bench/experiments/dma_probe.py --json "$DEST/dma-probe-$GPU.json"
fi
if want sweep; then
  step "copy-kernel sweep"
  # shellcheck disable=SC2086
  run io-sweep-$GPU "${SWEEP_TIMEOUT:-220}" $PY bench/experiments/io_sweep.py --json "$DEST/io-sweep-$GPU.json" ${SWEEP_ARGS:-}
fi
if want sglang; then
  step "SGLang's HiCache kernels against ours"
  if $PY -c "import tvm_ffi" 2>/dev/null || wheels .whl/apache_tvm_ffi-*.whl; then
    # shellcheck disable=SC2086
    run io-vs-sglang-$GPU "${SGLANG_TIMEOUT:-200}" $PY bench/scripts/io_vs_sglang.py --sglang-src .sglang_src/sglang/kernels/jit \
      --json "$DEST/io-vs-sglang-$GPU.json" ${SGLANG_ARGS:-}
  else
    echo "apache-tvm-ffi missing (install it, or put its wheel in .whl/)"; keep 1
  fi
fi
exit "$rc"
