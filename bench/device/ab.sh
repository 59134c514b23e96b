#!/usr/bin/env bash
# An A/B of the library on one GPU host: the same bench command on several trees, interleaved.
#
# With git:  bash bench/device/ab.sh prepare <commit> [more commits]
#   makes ab_<commit>/ (its hicache_cp, hostmem and pyproject.toml) beside the working tree.
#   Edit a copy by hand for a candidate fix (cp -r ab_<commit> ab_fix, then change it); copy the
#   working tree with them to the GPU host if it is another machine. Remove them after: rm -rf ab_*/
# On the GPU host:  AB_TREES="ab_<commit> . ab_fix" AB_ROUNDS=2 AB_TIMEOUT=150 \
#                   AB_CMD="bench-io --backends direct --pages 64 --kernel-sm-fractions= --runs-backends= --exposure-pages 8192" \
#                   bash bench/device/ab.sh run
#   runs `python -P -m hicache_harness $AB_CMD --json $DEST/ab-<round>-<tree>.json` with each tree alone
#   on PYTHONPATH (-P: the working directory's own hicache_cp is not put first), round by round
#   (interleaved, so drift hits every tree alike); each JSON names its tree as its commit
#   (HICACHE_COMMIT); every run's output goes to one $DEST/ab.log. Exit status: the first failing run's.
set -uo pipefail
cd "$(dirname "$0")/../.."

if [ "${1:-}" = prepare ]; then
  shift
  for commit in "$@"; do
    dir="ab_$commit"
    rm -rf "$dir" && mkdir "$dir" && git archive "$commit" hicache_cp hostmem pyproject.toml | tar -x -C "$dir" || exit 1
    echo "$dir: $(git rev-parse --short "$commit")"
  done
  exit 0
fi
[ "${1:-}" = run ] || { echo "usage: device_ab.sh prepare COMMIT... | run (see the header)" >&2; exit 2; }

DEFAULT_STEPS=""
source bench/device/env.sh
: "${AB_TREES:?AB_TREES names the trees (. is the working tree)}" "${AB_CMD:?AB_CMD is the hicache-cp command}"
for round in $(seq "${AB_ROUNDS:-2}"); do
  for tree in $AB_TREES; do
    name=$([ "$tree" = . ] && echo "head" || echo "$tree")
    label=$([ "$tree" = . ] && echo "$COMMIT" || echo "$tree")
    step "round $round: $name ($(PYTHONPATH=$tree $PY -P -c 'import hicache_cp; print(hicache_cp.__file__)'))" | tee -a "$DEST/ab.log"
    # shellcheck disable=SC2086 - AB_CMD is a command line
    { HICACHE_COMMIT=$label PYTHONPATH=$tree timeout "${AB_TIMEOUT:-150}" $PY -P -m hicache_harness $AB_CMD \
        --json "$DEST/ab-$round-$name.json" 2>&1; } | tee -a "$DEST/ab.log" | grep -E "^(exposure|overlap|targets)|rror"
    keep "${PIPESTATUS[0]}"
  done
done
exit "$rc"
