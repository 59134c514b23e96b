#!/usr/bin/env bash
# On a GPU host: where the scheduler thread's tree-cache time goes. After SGLang's setup
# (bench/device/sglang.sh's), the race of one workload and pool kind once per variant, each
# variant a line "NAME|ENV|ARGS" of VARIANTS (ENV: variables for that run, ARGS: more
# bench-sglang flags), then a table of every variant's per-call p50s and totals.
#
#   HICACHE_COMMIT=<hash> bash bench/device/sglang_variants.sh         # the default VARIANTS below
#
# Default variants (hicache-cp; SGLang's HiCache once, in the first):
#   base       as shipped
#   span       --io-option hook_span_inline=64: a run of backup layers issued by the hook in one driver call
#   gil        --switch-interval 0.0002: the scheduler thread waits less for the GIL
#   nocheck    --setting verify_restores=off: no restore checks
# Results: $DEST/sglang-variants-<gpu>-<commit>.{log,json} (the JSON: bench/device/variants.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
RACE_ARGS=${RACE_ARGS:-"--workloads embedded --pools mla --limit 100 --tree-core python"}
VARIANTS=${VARIANTS:-"base||--backends hicache-cp sglang-hicache
gil||--backends hicache-cp --switch-interval 0.0002
span||--backends hicache-cp --io-option hook_span_inline=64
nocheck||--backends hicache-cp --setting verify_restores=off"}
TAG=$GPU-$COMMIT
WORK=$(mktemp -d)
LOG=$DEST/sglang-variants-$TAG.log
{
header "VARIANTS=<${VARIANTS//$'\n'/; }> RACE_ARGS=\"$RACE_ARGS\" bash bench/device/sglang_variants.sh"
OUT=$WORK/setup STEPS=setup bash bench/device/sglang.sh > "$WORK/setup.txt" 2>&1 || { tail -20 "$WORK/setup.txt"; exit 3; }
export PYTHONPATH=$PWD:${SITE:-/tmp/sglang-site} SGLANG_FORCE_FUSED_OP_BACKEND=torch SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 \
  SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python SGLANG_JIT_CACHE_DIR=/tmp/sglang-jit HF_HUB_OFFLINE=1
while IFS='|' read -r name envs args; do
  [ -z "$name" ] && continue
  step "variant $name: ${envs:-no env} $args"
  # shellcheck disable=SC2086 - ENV and ARGS are lists
  env $envs timeout 240 "$PY" -m hicache_harness bench-sglang $RACE_ARGS $args --json "$WORK/$name.json" 2>&1 | grep -E "^\||wrote|rror"
  keep "${PIPESTATUS[0]}"
done <<< "$VARIANTS"
step "per-call p50 (us) and total (ms), every variant"
"$PY" bench/device/variants.py "$WORK" "$DEST/sglang-variants-$TAG.json" \
  --command "VARIANTS=<${VARIANTS//$'\n'/; }> RACE_ARGS=\"$RACE_ARGS\" bash bench/device/sglang_variants.sh"
echo "exit $rc"
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
