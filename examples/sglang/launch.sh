#!/usr/bin/env bash
# SGLang 0.5.23 with hicache-cp as its host (L2) tier. hicache-cp must be installed in the Python
# that runs SGLang (its entry point registers --radix-cache-backend hicache-cp in every process).
#   bash examples/sglang/launch.sh [more SGLang flags]      # MODEL=... picks another model
# Do not add --enable-hierarchical-cache: hicache-cp is the host tier.
set -euo pipefail
export HICACHE_CP_CONFIG=${HICACHE_CP_CONFIG:-$(dirname "$0")/hicache.toml}
exec python -m sglang.launch_server \
  --model-path "${MODEL:-deepseek-ai/DeepSeek-V3.2}" \
  --page-size 64 \
  --radix-cache-backend hicache-cp \
  "$@"
