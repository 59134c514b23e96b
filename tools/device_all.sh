#!/usr/bin/env bash
# Everything this project measures on the device machine, in one call
# (device time is scarce). Run from the repository root on nvidia-h200-x2:
#   bash tools/device_all.sh
# Needs the trace copied to .devdata/ (carried, never committed). Results go to
# $OUT (or bench/results): logs, io-h200.json, pinning-h200.json, replay JSONs.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
DEST=${OUT:-bench/results}
TRACE=${TRACE:-.devdata/synthetic_trace.jsonl}
mkdir -p "$DEST"
step() { echo; echo "=== $* ($(date +%T))"; }

step nvidia-smi
nvidia-smi --query-gpu=index,name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv

step "GPU tests (pytest -m gpu)"
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tail -40 | tee "$DEST/gpu-tests.log"

step "bench-io"
timeout 100 python3 -m hicache_cp bench-io --json "$DEST/io-h200.json" 2>&1 | tail -40

if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  step "replay cp2 on two GPUs (NCCL), DeepSeek-V3.2 layout"
  timeout 130 python3 -m hicache_cp replay --trace "$TRACE" --config tools/deepseek-v3.2.toml --limit 500 \
    --l2-fraction 0.1 --device cuda --cp-size 2 --json "$DEST/cp2-h200x2.json" 2>&1 | grep -v "replay:" | tail -30
fi

step "replay cp1 on one GPU, DeepSeek-V3.2 layout"
timeout 100 python3 -m hicache_cp replay --trace "$TRACE" --config tools/deepseek-v3.2.toml --limit 500 \
  --l2-fraction 0.1 --device cuda --json "$DEST/replay-h200-cp1.json" 2>&1 | grep -v "replay:" | tail -30

step "pinning bench (64 GiB)"
timeout 130 python3 tools/bench_pinning.py --gib 64 --json "$DEST/pinning-h200.json" 2>&1 | tail -25
