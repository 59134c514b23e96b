#!/usr/bin/env bash
# Pinned host pools on a GPU host (about 3.5-4 minutes on a host with 128 GiB of RAM):
# the arena/sizing/bench tests (GPU ones included, ~20 s), then the benchmark.
#   bash bench/device/pinning.sh
# writes $DEST/pinning-$GPU.json and $DEST/pinning-$GPU.log ($DEST: OUT, else bench/results).
#
# Sizes: 64 GiB (the yardstick, with the variant sweep), then the largest pool this
# machine allows: what hostmem.sizing reports available (cgroup limit or MemAvailable)
# minus a 16 GiB reserve, rounded down to 8 GiB and capped at 112. On a host with 128 GiB
# of RAM that is about 96-104 GiB. The reserve is for the OS, this process (CUDA context,
# torch, Python: about 4 GiB), the 4 GiB pageable copy buffer and the page cache: pinned
# memory cannot be reclaimed, so an OOM kill would lose the run.
# LARGE_GIB=<n> overrides the second size (0 skips it); BASE_GIB the first
# (a dry run on CPU: BASE_GIB=0.25 LARGE_GIB=0 OUT=/tmp/p bash bench/device/pinning.sh).
#
# Time: at 64 GiB, 1 warm-up + 2 default arenas + 6 variants at ~2-6 s each
# (ready + close), cudaHostAlloc ~28 s + free; at the large size warm-up, 2
# default arenas and cudaHostAlloc ~45 s. The sweep is at 64 GiB only.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
{
  echo "=== machine ($(date +%T))"
  uname -r; nproc
  grep -E "MemTotal|MemAvailable|AnonHugePages|HugePages_(Total|Free)|Hugepagesize" /proc/meminfo
  for f in enabled defrag khugepaged/defrag; do
    echo "thp $f: $(cat /sys/kernel/mm/transparent_hugepage/$f 2>/dev/null)"
  done
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.total --format=csv || true
} 2>&1 | tee "$DEST/pinning-$GPU.log"

echo "=== arena and bench-pinning tests, GPU included ($(date +%T))" | tee -a "$DEST/pinning-$GPU.log"
timeout 150 $PY -m pytest -q -p no:cacheprovider tests/test_arena.py tests/test_sizing.py tests/test_bench_pinning.py 2>&1 \
  | tail -15 | tee -a "$DEST/pinning-$GPU.log"
trc=${PIPESTATUS[0]}

LARGE=${LARGE_GIB:-$($PY -c "
from hostmem.sizing import host_memory
m = host_memory(reserve_bytes=16 << 30)
print(m.describe(), file=__import__('sys').stderr)
print(min(112, (m.pool_bytes >> 30) // 8 * 8))
" 2>>"$DEST/pinning-$GPU.log")}
BASE=${BASE_GIB:-64}
SIZES=$BASE
if [ "${LARGE:-0}" -gt 64 ]; then SIZES="$BASE,$LARGE"; fi
echo "=== bench-pinning --gib $SIZES ($(date +%T))" | tee -a "$DEST/pinning-$GPU.log"
timeout 480 $PY -m hicache_harness.bench.pinning --gib "$SIZES" --json "$DEST/pinning-$GPU.json" 2>&1 \
  | tee -a "$DEST/pinning-$GPU.log" | grep -v '^\[bench-pinning\] .*: {' | tail -40
rc=${PIPESTATUS[0]}
echo "=== done: tests rc=$trc, bench rc=$rc ($(date +%T))" | tee -a "$DEST/pinning-$GPU.log"
[ "$trc" -ne 0 ] && exit "$trc"
exit "$rc"
