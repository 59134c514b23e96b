#!/usr/bin/env bash
# What this project measures on a GPU host, step by step. From the repository root:
#
#   STEPS="tests replay replay2" bash bench/device/all.sh   # replay2 needs two GPUs
#   STEPS="pinning serve" bash bench/device/all.sh          # serve needs the wheels in .whl/
#
# Steps:
#   tests     pytest -m gpu: arena and pinning, copy engines, the CUDA state machine, 2-GPU CP replays
#   replay    a Mooncake-format trace on one GPU, DeepSeek-V3.2 layout, L2 = 10% (target < 60 s)
#   replay2   the same on two GPUs, CP 2 over NCCL (NVLink multicast off)
#   io        bench-io; overhead: bench-overhead (bench/device/io.sh)
#   pinning   bench/device/pinning.sh (64 GiB and the largest pool the machine allows)
#   serve     bench/device/serve.sh (real-width DeepSeek-V3.2)
# The replays read the trace from TRACE (default .devdata/synthetic_trace.jsonl; not committed:
# any trace of the Mooncake format). Every result goes to $DEST (bench/results unless OUT is
# set), named with the GPU's tag ($GPU, bench/device/env.sh): JSON with the commit, the machine
# and the command, and one log per step starting with the same.
set -uo pipefail
cd "$(dirname "$0")/../.."
DEFAULT_STEPS="tests replay"
source bench/device/env.sh
export NCCL_NVLS_ENABLE=0
TRACE=${TRACE:-.devdata/synthetic_trace.jsonl}
LIMIT=${LIMIT:+--limit $LIMIT}

nvidia-smi --query-gpu=index,name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv || true

if want tests; then
  step "GPU tests"
  cmd="$PY -m pytest -m gpu -q -p no:cacheprovider -rs tests"
  { header "$cmd"; timeout "${TESTS_TIMEOUT:-300}" $cmd 2>&1 | tail -40; } | tee "$DEST/gpu-tests-$GPU.log"
  keep "${PIPESTATUS[0]}"
fi

if want replay; then
  step "replay cp1 on one GPU, DeepSeek-V3.2 layout"
  timeout "${REPLAY_TIMEOUT:-170}" $PY -m hicache_harness replay --trace "$TRACE" --config bench/device/deepseek-v3.2.toml $LIMIT \
    --l2-fraction 0.1 --device cuda --json "$DEST/replay-$GPU-cp1.json" 2>&1 | grep -v "replay:.*req" | tail -30
  keep "${PIPESTATUS[0]}"
fi

if want replay2; then
  step "replay cp2 on two GPUs (NCCL), DeepSeek-V3.2 layout"
  timeout "${REPLAY_TIMEOUT:-170}" $PY -m hicache_harness replay --trace "$TRACE" --config bench/device/deepseek-v3.2.toml $LIMIT \
    --l2-fraction 0.1 --device cuda --cp-size 2 --json "$DEST/cp2-${GPU}x2.json" 2>&1 | grep -v "replay:.*req" | tail -30
  keep "${PIPESTATUS[0]}"
fi

if want io || want overhead; then
  step "copy engines"
  STEPS="$(want io && echo io) $(want overhead && echo overhead)" OUT="$DEST" bash bench/device/io.sh
  keep $?
fi

if want pinning; then
  step "pinning"
  OUT="$DEST" bash bench/device/pinning.sh
  keep $?
fi

if want serve; then
  step "serve"
  OUT="$DEST" bash bench/device/serve.sh
  keep $?
fi
exit "$rc"
