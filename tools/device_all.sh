#!/usr/bin/env bash
# What this project measures on the device machine, in one call (device time
# is scarce). Run from the repository root, on nvidia-h200-x2 for the 2-GPU
# steps:
#   HICACHE_COMMIT=<hash> STEPS="tests io" bash tools/device_all.sh
# STEPS picks from: tests io replay replay2 pinning (default: all but replay2:
# replay runs one GPU, replay2 two GPUs with NCCL); LIMIT caps the replayed
# requests (default: the whole trace). The replays need
# the trace copied to .devdata/ (carried, never committed). Results go to
# $OUT (or bench/results). HICACHE_COMMIT names the commit in every JSON (the
# device gets the working tree without .git).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
DEST=${OUT:-bench/results}
TRACE=${TRACE:-.devdata/synthetic_trace.jsonl}
STEPS=${STEPS:-tests io replay pinning}
LIMIT=${LIMIT:+--limit $LIMIT}
mkdir -p "$DEST"
step() { echo; echo "=== $* ($(date +%T))"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }

step nvidia-smi
nvidia-smi --query-gpu=index,name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv

if want tests; then
  step "GPU tests (pytest -m gpu: engine, CUDA hypothesis machine, 2-rank NCCL replays)"
  timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests 2>&1 | tail -40 | tee "$DEST/gpu-tests.log"
fi

if want io; then
  step "bench-io"
  timeout 150 python3 -m hicache_cp bench-io --json "$DEST/io-h200.json" 2>&1 | tail -45
fi

if want replay; then
  step "replay cp1 on one GPU, DeepSeek-V3.2 layout"
  timeout 400 python3 -m hicache_cp replay --trace "$TRACE" --config tools/deepseek-v3.2.toml $LIMIT \
    --l2-fraction 0.1 --device cuda --json "$DEST/replay-h200-cp1.json" 2>&1 | grep -v "replay:" | tail -30
fi

if want replay2; then
  step "replay cp2 on two GPUs (NCCL), DeepSeek-V3.2 layout"
  timeout 400 python3 -m hicache_cp replay --trace "$TRACE" --config tools/deepseek-v3.2.toml $LIMIT \
    --l2-fraction 0.1 --device cuda --cp-size 2 --json "$DEST/cp2-h200x2.json" 2>&1 | grep -v "replay:" | tail -30
fi

if want pinning; then
  step "pinning bench (64 GiB)"
  timeout 130 python3 tools/bench_pinning.py --gib 64 --json "$DEST/pinning-h200.json" 2>&1 | tail -25
fi
