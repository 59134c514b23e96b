#!/usr/bin/env bash
# What this project measures on the device machine, in as few calls as the
# 10-minute limit allows (device time is scarce). From the repository root:
#
#   HICACHE_COMMIT=<hash> STEPS="tests replay replay2" bash tools/device_all.sh   # call 1, nvidia-h200-x2
#   HICACHE_COMMIT=<hash> STEPS="pinning serve" bash tools/device_all.sh          # call 2, carry [".whl", ".devdata"]
#
# Steps:
#   tests     pytest -m gpu: arena and pinning, copy engines, the CUDA state machine, 2-GPU CP replays
#   replay    the full shared trace on one GPU, DeepSeek-V3.2 layout, L2 = 10% (target < 60 s)
#   replay2   the same on two GPUs, CP 2 over NCCL (NVLink multicast off)
#   io        bench-io; overhead: bench-overhead (tools/device_io.sh)
#   pinning   tools/device_pinning.sh (64 GiB and the largest pool the machine allows)
#   serve     tools/device_serve.sh (real-width DeepSeek-V3.2, needs the wheels in .whl/)
# The replays read the trace from .devdata/ (carried, never committed). Every
# result goes to $OUT (bench/results off the device): JSON with the commit,
# the machine and the command, and one log per step starting with the same.
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_STEPS="tests replay"
source tools/device_env.sh
export NCCL_NVLS_ENABLE=0
TRACE=${TRACE:-.devdata/synthetic_trace.jsonl}
LIMIT=${LIMIT:+--limit $LIMIT}

nvidia-smi --query-gpu=index,name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv || true

if want tests; then
  step "GPU tests"
  cmd="$PY -m pytest -m gpu -q -p no:cacheprovider -rs tests"
  { header "$cmd"; timeout "${TESTS_TIMEOUT:-300}" $cmd 2>&1 | tail -40; } | tee "$DEST/gpu-tests.log"
  keep "${PIPESTATUS[0]}"
fi

if want replay; then
  step "replay cp1 on one GPU, DeepSeek-V3.2 layout"
  timeout "${REPLAY_TIMEOUT:-170}" $PY -m hicache_cp replay --trace "$TRACE" --config tools/deepseek-v3.2.toml $LIMIT \
    --l2-fraction 0.1 --device cuda --json "$DEST/replay-h200-cp1.json" 2>&1 | grep -v "replay:.*req" | tail -30
  keep "${PIPESTATUS[0]}"
fi

if want replay2; then
  step "replay cp2 on two GPUs (NCCL), DeepSeek-V3.2 layout"
  timeout "${REPLAY_TIMEOUT:-170}" $PY -m hicache_cp replay --trace "$TRACE" --config tools/deepseek-v3.2.toml $LIMIT \
    --l2-fraction 0.1 --device cuda --cp-size 2 --json "$DEST/cp2-h200x2.json" 2>&1 | grep -v "replay:.*req" | tail -30
  keep "${PIPESTATUS[0]}"
fi

if want io || want overhead; then
  step "copy engines"
  STEPS="$(want io && echo io) $(want overhead && echo overhead)" OUT="$DEST" bash tools/device_io.sh
  keep $?
fi

if want pinning; then
  step "pinning"
  OUT="$DEST" bash tools/device_pinning.sh
  keep $?
fi

if want serve; then
  step "serve"
  OUT="$DEST" bash tools/device_serve.sh
  keep $?
fi
exit "$rc"
