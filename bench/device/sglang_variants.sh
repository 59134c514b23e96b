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
#   nocheck    HICACHE_VERIFY_RESTORES=off: no restore checks
# Results: $DEST/sglang-variants-<gpu>-<commit>.{log,json}.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
RACE_ARGS=${RACE_ARGS:-"--workloads embedded --pools mla --limit 100 --tree-core python"}
VARIANTS=${VARIANTS:-"base||--backends hicache-cp sglang-hicache
gil||--backends hicache-cp --switch-interval 0.0002
span||--backends hicache-cp --io-option hook_span_inline=64
nocheck|HICACHE_VERIFY_RESTORES=off|--backends hicache-cp"}
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
"$PY" - "$WORK" "$DEST/sglang-variants-$TAG.json" <<'EOF'
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
merged = {}
for f in sorted(work.glob("*.json")):
    d = json.loads(f.read_text())
    merged[f.stem] = d
    for wl, rows in d["workloads"].items():
        for r in rows:
            if "calls" not in r:
                print(f.stem, r["backend"], "failed:", r.get("error"))
                continue
            print(f"== {f.stem} {wl} {r['pools']} {r['backend']}: tree-cache {r['tree_cache_ms_per_request']:.2f} ms/request, "
                  f"hooks {r['hook_ms_per_request']:.2f}, wall {r['wall_s']:.2f} s, exposed backup {r.get('exposed_backup_fraction')}")
            for k, c in sorted(r["calls"].items(), key=lambda kv: -kv[1]["total_ms"])[:10]:
                print(f"   {k:34s} {c['calls']:6d} p50 {c['p50_us']:8.1f} p99 {c['p99_us']:8.1f} total {c['total_ms']:8.1f}")
out.write_text(json.dumps(merged, indent=1) + "\n")
print("wrote", out)
EOF
echo "exit $rc"
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
