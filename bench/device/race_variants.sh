#!/usr/bin/env bash
# On a GPU host, after bench/device/sglang.sh's setup (run here if SETUP=1): the SGLang race
# (embedded workload, MLA pools, SGLang's Python tree core, bytes unchecked) once per variant,
# each with --breakdown, then both backends under cProfile (its text beside each profile):
#
#   OUT=/tmp/r SETUP=1 VARIANTS="backup_submits_per_forward=4 backup_submits_per_forward=2" \
#     bash bench/device/race_variants.sh
#
# -> $DEST/race-base.{json,log} (hicache-cp and SGLang's HiCache), race-<field>-<value>.{json,log}
#    (hicache-cp alone with --setting FIELD=VALUE), race-prof.log and prof/*.txt. Carry .sglang.
# RACE_EXTRA adds flags to every race (a CPU rehearsal: WHEELS=0 PYTHON=.venv/bin/python
# RACE_EXTRA="--layers 4 --dim 64" RACE_LIMIT=4).
set -uo pipefail
cd "$(dirname "$0")/../.."
DEFAULT_STEPS=""
source bench/device/env.sh
FLAGS="--workloads embedded --pools mla --tree-core python --no-check ${RACE_EXTRA:-}"

# race NAME FLAGS...: one race through sglang.sh's race step, its JSON and log renamed after NAME
race() {
  local name=$1
  shift
  STEPS=race RACE_LIMIT=${RACE_LIMIT:-100} RACE_ARGS="$FLAGS $*" DEADLINE=${RACE_DEADLINE:-240} OUT=$DEST \
    bash bench/device/sglang.sh > "$DEST/$name.log" 2>&1
  keep $?
  mv "$DEST"/sglang-race-*.json "$DEST/$name.json" 2>/dev/null
  rm -f "$DEST"/sglang-race-*.log "$DEST"/sglang-steps-*.txt
  grep -E "^\| " "$DEST/$name.log" | head -40
}

if [ "${SETUP:-0}" = 1 ]; then
  STEPS=setup OUT=$DEST bash bench/device/sglang.sh > "$DEST/race-setup.log" 2>&1
  keep $?
fi
race race-base --backends hicache-cp sglang-hicache --breakdown
for v in ${VARIANTS:-}; do
  race "race-${v//[=_]/-}" --backends hicache-cp --breakdown --setting "$v"
done
[ "${PROFILE:-1}" = 1 ] && race race-prof --backends hicache-cp sglang-hicache --profile "$DEST/prof"
exit "$rc"
