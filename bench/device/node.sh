#!/usr/bin/env bash
# The node tier on one GPU host, from the repository root:
#
#   HICACHE_COMMIT=<hash> bash bench/device/node.sh        # nothing to prepare
#
# Steps (STEPS picks; default "tests firsthit"):
#   tests     pytest -m gpu tests/test_node_gpu.py: two rank processes on cuda:0 map and register one
#             segment, back up (each its share) and load through it, a restarted pair adopts it; every
#             byte of every reused page checked on the GPU (the oracle, and the restore checks' kernel
#             against the segment's shared checksum table); a bit flipped in rank 1's slice is caught
#             by rank 0's GPU check and dropped on both; a pinned arena over a segment region copies
#             both ways byte-exact -> $DEST/node-gpu-tests.log
#   firsthit  bench-node --first-hit-gib G --device cuda: a DeepSeek-V3.2-layout cache over a G GiB
#             pinned segment (G: FIRST_HIT_GIB, default the smaller of 64 and 80% of what /dev/shm
#             and MemAvailable leave) serves prompts, closes; a new cache opens, prefaults, registers,
#             adopts and serves one: the seconds to that first hit, every byte checked; plus the CPU
#             parts of bench-node (adoption against journal size, checksum rate, prefault, NUMA)
#             -> $DEST/node-$GPU.json, $DEST/node-firsthit.log
# Each log starts with the commit, the machine and the command. Exit status: the first failing step's.
set -uo pipefail
cd "$(dirname "$0")/../.."
DEFAULT_STEPS="tests firsthit"
source bench/device/env.sh

nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv || true
df -h /dev/shm; grep -E "MemAvailable|HugePages_(Total|Free)" /proc/meminfo
ls /dev/shm | grep -c hicache-cp-test && echo "stale test segments above" || true

if want tests; then
  step "node tier GPU tests"
  cmd="$PY -m pytest -m gpu tests/test_node_gpu.py -q -p no:cacheprovider -rs -o faulthandler_timeout=300"
  { header "$cmd"; timeout "${TESTS_TIMEOUT:-300}" $cmd 2>&1 | tail -40; } | tee "$DEST/node-gpu-tests.log"
  keep "${PIPESTATUS[0]}"
fi

if want firsthit; then
  step "first hit after a restart (pinned segment)"
  shm_gib=$(df --output=avail -B1G /dev/shm | tail -1 | tr -d ' ')
  mem_gib=$(( $(grep MemAvailable /proc/meminfo | awk '{print $2}') / 1048576 ))
  room=$(( (shm_gib < mem_gib ? shm_gib : mem_gib) * 8 / 10 ))
  gib=${FIRST_HIT_GIB:-$(( room < 64 ? room : 64 ))}
  cmd="$PY -m hicache_harness bench-node --first-hit-gib $gib --device cuda --replay-limit 0 --json $DEST/node-$GPU.json"
  { header "$cmd"; timeout "${FIRSTHIT_TIMEOUT:-240}" $cmd 2>&1 | tail -20; } | tee "$DEST/node-firsthit.log"
  keep "${PIPESTATUS[0]}"
fi
ls /dev/shm | grep hicache-cp && { echo "segments left in /dev/shm"; keep 1; } || true
exit "$rc"
