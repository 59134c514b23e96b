#!/usr/bin/env bash
# On a GPU host (vLLM not installed there): vLLM 0.33.0's own GPU model runner with hicache-cp's
# connector, and the three-way race against vLLM's OffloadingConnector and no connector.
# Prepare here, then one device call:
#
#   .venv/bin/python bench/engines/vllm_pack.py --sdist vllm-0.33.0.tar.gz --cutlass nvidia_cutlass-4.2.0.0-py3-none-any.whl
#   HICACHE_COMMIT=<hash> bash bench/device/vllm_race.sh               # there, with .vllm/ beside the tree
#   quick: STEPS="ops smoke" ...                                         # about 2 minutes
#
# Steps (each logged to $DEST/vllm-race.log, which starts with commit, machine and command):
#   setup   .vllm/whl into $SITE (pip --no-index --no-deps), vllm-src.tar.gz over it
#   ops     bench/engines/vllm_ops/build.py: vLLM's own ops from the sdist's csrc -> $SITE/vllm (-> vllm-ops.json)
#   tests   the connector's GPU tests (-m gpu): the worker's CUDA path (planned copies, restore
#           checks on the GPU, hooks, faults) under vLLM's real Scheduler, and the checksum
#           kernel's (-> vllm-race-junit.xml)
#   smoke   bench/engines/vllm_race.py --quick --eager: a small Llama, eager, with our connector
#           (-> vllm-smoke.json): vLLM's runner starts, saves commit, pass 2 loads from host
#   race    bench/engines/vllm_race.py: an untimed priming run, then the 3 configurations with CUDA
#           graphs (-> vllm-race.json);
#           RACE_CONFIGS picks them, RACE_ARGS adds flags (e.g. --profile, --extra verify_restores=off)
#   diag    our connector alone twice more: --profile (the start-up's and the batch's top functions,
#           -> vllm-profile.{json,log}) and --extra verify_restores=off (-> vllm-nocheck.json)
#   variant our connector alone once more with VARIANT_EXTRA, settings as --extra takes them
#           (default backup_submits_per_forward=2; -> $VARIANT_NAME.json, default vllm-variant)
# Every step has its own timeout; a failed step does not stop the next. Exit: the first failure.
set -uo pipefail
cd "$(dirname "$0")/../.."
SITE=${SITE:-/tmp/vllm-site}
DEFAULT_STEPS="ops tests smoke race"
source bench/device/env.sh
# vLLM's own switch off its FlashInfer sampler (flashinfer is not on the image; PyTorch sampling runs)
export HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_USE_FLASHINFER_SAMPLER=0
LOG=$DEST/vllm-race.log
{
header "STEPS=\"$STEPS\" bash bench/device/vllm_race.sh"
step setup
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .vllm/whl/*.whl || exit 3
tar -xzf .vllm/vllm-src.tar.gz -C "$SITE" || exit 3
export PYTHONPATH=$PWD:$SITE
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"

if want ops; then
  step "vLLM's ops from the sdist's csrc (bench/engines/vllm_ops/build.py)"
  timeout "${OPS_TIMEOUT:-300}" $PY bench/engines/vllm_ops/build.py --csrc .vllm/csrc --site "$SITE" \
    --json "$DEST/vllm-ops.json" 2>&1 | grep -v "^\[[0-9]*/[0-9]*\] " | tail -40
  keep "${PIPESTATUS[0]}"
fi

if want tests; then
  step "the connector's GPU tests (-m gpu)"
  timeout "${TESTS_TIMEOUT:-180}" $PY -m pytest -q -p no:cacheprovider -rfEs -m gpu -o junit_family=xunit1 \
    --junitxml="$DEST/vllm-race-junit.xml" tests/test_vllm_connector.py tests/test_vllm_plan.py \
    tests/test_vllm_worker_cost.py tests/test_plugin_restore_checks.py tests/test_checksum_gpu.py 2>&1 | tail -60
  keep "${PIPESTATUS[0]}"
fi

if want smoke; then
  step "vllm.LLM eager, a small Llama, our connector"
  timeout "${SMOKE_TIMEOUT:-100}" $PY bench/engines/vllm_race.py --quick --eager --configs hicache --no-prime \
    --timeout 90 --json "$DEST/vllm-smoke.json" 2>&1 | tail -60
  keep "${PIPESTATUS[0]}"
fi

if want race; then
  step "the race: ours, vLLM's OffloadingConnector, no connector (CUDA graphs)"
  # shellcheck disable=SC2086 - RACE_ARGS is a list of flags
  timeout "${RACE_TIMEOUT:-440}" $PY bench/engines/vllm_race.py --configs "${RACE_CONFIGS:-hicache,offloading,none}" \
    --timeout "${RUN_TIMEOUT:-110}" --json "$DEST/vllm-race.json" ${RACE_ARGS:-} 2>&1 | tail -"${RACE_TAIL:-80}"
  keep "${PIPESTATUS[0]}"
fi
if want diag; then
  step "our connector alone, profiled (start-up and batch), then without restore checks"
  timeout "${DIAG_TIMEOUT:-150}" $PY bench/engines/vllm_race.py --configs hicache --no-prime --profile --timeout 140 \
    --json "$DEST/vllm-profile.json" > "$DEST/vllm-profile.log" 2>&1
  keep $?
  grep -A 45 -E "^--- profile of hicache (start-up|batch), by (tottime|cumulative)" "$DEST/vllm-profile.log" | cut -c1-160 | head -200
  timeout "${DIAG_TIMEOUT:-150}" $PY bench/engines/vllm_race.py --configs hicache --no-prime --extra verify_restores=off \
    --timeout 140 --json "$DEST/vllm-nocheck.json" 2>&1 | tail -16
  keep "${PIPESTATUS[0]}"
fi
if want variant; then
  step "our connector alone with ${VARIANT_EXTRA:=backup_submits_per_forward=2}"
  # shellcheck disable=SC2086 - VARIANT_EXTRA is a list of KEY=VALUE
  timeout "${DIAG_TIMEOUT:-150}" $PY bench/engines/vllm_race.py --configs hicache --no-prime \
    $(printf -- "--extra %s " $VARIANT_EXTRA) --timeout 140 --json "$DEST/${VARIANT_NAME:-vllm-variant}.json" 2>&1 | tail -16
  keep "${PIPESTATUS[0]}"
fi
echo "exit $rc"
exit $rc
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
