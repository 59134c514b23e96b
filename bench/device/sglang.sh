#!/usr/bin/env bash
# On a GPU host (SGLang not installed there): SGLang 0.5.23's Python on the image's torch 2.11, its own HiCache
# JIT kernels, the SGLang plug-in's tests on CUDA, the race against SGLang's HiCache and a real
# sglang.Engine three ways. Prepare .sglang and .devdata here and copy them beside the tree on the
# GPU host, then run from the repository root (each call stops starting steps after DEADLINE):
#
#   .venv/bin/python bench/engines/sglang_pack.py            # here: .sglang/ (sources, wheels, stand-in; ~37 MiB)
#   mkdir -p .devdata && cp <the Mooncake-format trace> .devdata/synthetic_trace.jsonl
#   HICACHE_COMMIT=<hash> STEPS="setup import jit tests race" RACE_LIMIT=100 bash bench/device/sglang.sh  # call 1
#   HICACHE_COMMIT=<hash> STEPS="setup engine" ENGINE_MODELS="deepseek llama" bash bench/device/sglang.sh  # call 2
#   HICACHE_COMMIT=<hash> STEPS=smoke bash bench/device/sglang.sh                         # every step small, ~5 min
#
# A CPU rehearsal (no GPU; the venv holds SGLang and every wheel): WHEELS=0 skips the setup's
# install, and each step runs as far as a CPU lets it (the trace fakes CUDA, the GPU tests
# collect and skip, the race runs radix and hicache-cp on CPU, the engine only checks its
# arguments with ENGINE_ARGS=--check-args):
#   WHEELS=0 PYTHON=.venv/bin/python OUT=/tmp/rehearsal STEPS="setup import jit tests race engine" \
#     RACE_ARGS="--limit 4 --layers 4 --dim 64 --device-pages 64" ENGINE_ARGS=--check-args bash bench/device/sglang.sh
#
# Steps, run in this order whatever the order of STEPS (each independent: one that fails or times
# out is logged and the next runs; each log in $DEST starts with the commit, the machine and the
# command; files named <what>-<gpu>-<commit>):
#   setup    .sglang/whl/*.whl into $SITE (pip --no-index --no-deps --target), sglang-src.tar.gz over it
#            (SGLang, its cp312 Rust tree core, the sgl_kernel stand-in, hicache-cp's plug-in entry point);
#            WHEELS=0: nothing installed, the versions printed
#   import   bench/engines/sglang_pack.py trace: SGLang's modules imported on the GPU, the stand-in names they
#            import, whether the Rust tree core loads                       -> sglang-import-*.json
#   jit      bench/engines/sglang_jit_check.py: SGLang's HiCache JIT kernels built by its own load_jit, a
#            byte-exact host<->device round trip through its controller (MLA, MHA; page_first,
#            layer_first)                                                   -> sglang-jit-*.json
#   tests    pytest -m gpu: the GPU tests of tests/test_sglang_radix.py, test_sglang_blockers.py and
#            test_sglang_race.py (their CPU tests run in CI)               -> sglang-tests-*.log, junit
#   race     hicache-cp bench-sglang: radix / hicache-cp / SGLang's HiCache on the shared trace and the
#            embedded workload, MLA and DSA pools (RACE_ARGS adds flags; it gets what the deadline
#            leaves, and its JSON is written after each workload)         -> sglang-race-*.json
#   engine   bench/engines/sglang_engine.py for each of ENGINE_MODELS (default "deepseek"; "llama" too),
#            ENGINE_ARGS added to its flags           -> sglang-engine-<model>[-$ENGINE_TAG]-*.json
#   smoke    setup, then every step small (import subset, jit on MLA page_first, race of 20 requests on
#            8 layers, engine --quick on deepseek)
# A whole call stops starting steps DEADLINE seconds (default 570) after it began; each step's timeout
# is cut to what is left. Exit status: the first failing step's.
set -uo pipefail
cd "$(dirname "$0")/../.."
DEFAULT_STEPS="setup import jit race"
source bench/device/env.sh
DEADLINE=${DEADLINE:-570}
SITE=${SITE:-/tmp/sglang-site}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i -E 'h100|h200|a100|b200' | tr 'A-Z' 'a-z')
GPU=${GPU:-cpu}
TAG=$GPU-$COMMIT
export HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export SGLANG_FORCE_FUSED_OP_BACKEND=torch SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
# SGLang's Rust tree core, built against another torch, panics on the image's (TypeMeta; its plain
# RadixCache and its HiCache alike): the engines run its Python core, as the race does (--tree-core python)
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=${SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND:-python}
export SGLANG_JIT_CACHE_DIR=${SGLANG_JIT_CACHE_DIR:-/tmp/sglang-jit} TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD:$SITE PY
if want smoke; then STEPS="setup import jit race tests engine"; SMOKE=1; else SMOKE=0; fi

# run NAME LIMIT CMD...: one step's command under min(LIMIT, what the deadline leaves), its log in $DEST/NAME.log
run() {
  local name=$1 limit=$2 left
  shift 2
  left=$((DEADLINE - SECONDS - 5))
  if [ "$left" -lt 20 ]; then
    echo "!! $name: not started, $left s left before the ${DEADLINE} s deadline" | tee -a "$DEST/sglang-steps-$TAG.txt"
    keep 124
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  { header "$*"; echo "# timeout ${limit} s"; timeout -k 10 "$limit" "$@" 2>&1; } | tee "$DEST/$name.log"
  local code=${PIPESTATUS[0]}
  echo "$name: exit $code after $((SECONDS - t0)) s (limit $limit s)" | tee -a "$DEST/sglang-steps-$TAG.txt"
  keep "$code"
}

{ header "STEPS=\"$STEPS\" bash bench/device/sglang.sh"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; } \
  | tee "$DEST/sglang-steps-$TAG.txt"

if want setup; then
  step setup
  run "sglang-setup-$TAG" 180 bash -c '
    set -e
    if [ "${WHEELS:-1}" = 1 ]; then
      rm -rf "$0" && mkdir -p "$0"
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$0" .sglang/whl/*.whl
      tar -xzf .sglang/sglang-src.tar.gz -C "$0"
    fi
    "$PY" -m pip list 2>/dev/null | grep -i -E "^(torch|triton|numpy|transformers|huggingface.hub|tokenizers) " || true
    "$PY" -c "import transformers, tvm_ffi, sglang, torch; print(\"transformers\", transformers.__version__, transformers.__file__); print(\"tvm_ffi\", tvm_ffi.__file__); print(\"sglang\", sglang.__file__); print(\"torch\", torch.__version__, torch.version.cuda)"
    which nvcc && nvcc --version | tail -2
    head -c 800 .sglang/manifest.json; echo' "$SITE"
fi

if want import; then
  step "import SGLang on the GPU (the stand-in's names, the Rust tree core)"
  mods=""
  [ "$SMOKE" = 1 ] && mods="sglang.srt.mem_cache.unified_radix_cache sglang.srt.models.deepseek_v2 sglang.srt.entrypoints.engine"
  # shellcheck disable=SC2086 - mods is a list of module names
  run "sglang-import-$TAG" 240 bash -c "$PY bench/engines/sglang_pack.py trace --site $SITE $mods > $DEST/sglang-import-$TAG.json; rc=\$?; \
    $PY -c 'import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if k != \"distributions\"})' $DEST/sglang-import-$TAG.json; \
    $PY -c 'import torch; from sglang.srt.mem_cache.rust_tree_core import extension as e; print(\"rust tree core loads:\", e.bindings.__file__)' \
      || echo 'rust tree core does not load (SGLang runs its Python core)'; exit \$rc"
fi

if want jit; then
  step "SGLang's HiCache JIT kernels: build and byte-exact round trip"
  cases=""
  [ "$SMOKE" = 1 ] && cases="--cases mla:page_first"
  # shellcheck disable=SC2086
  run "sglang-jit-$TAG" 300 "$PY" bench/engines/sglang_jit_check.py --json "$DEST/sglang-jit-$TAG.json" $cases
fi

if want tests; then
  step "the SGLang plug-in's GPU tests"
  files="tests/test_sglang_radix.py tests/test_sglang_blockers.py tests/test_sglang_race.py"
  [ "$SMOKE" = 1 ] && files="tests/test_sglang_race.py"
  # shellcheck disable=SC2086
  run "sglang-tests-$TAG" 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfEs -o faulthandler_timeout=120 \
    --continue-on-collection-errors -o junit_family=xunit1 --junitxml="$DEST/sglang-tests-$TAG.xml" $files
fi

if want race; then
  step "the race: hicache-cp against SGLang's HiCache, one process, one GPU"
  args=${RACE_ARGS:-}
  [ "$SMOKE" = 1 ] && args="--limit 20 --layers 8 --workloads embedded $args"
  # shellcheck disable=SC2086 - RACE_ARGS is a list of flags
  run "sglang-race-$TAG" 480 "$PY" -m hicache_harness -v bench-sglang --json "$DEST/sglang-race-$TAG.json" \
    --limit "${RACE_LIMIT:-150}" $args
fi

if want engine; then
  step "sglang.Engine three ways"
  models=${ENGINE_MODELS:-deepseek}
  quick=""
  if [ "$SMOKE" = 1 ]; then models=deepseek; quick=--quick; fi
  for m in $models; do
    # shellcheck disable=SC2086
    name=sglang-engine-$m${ENGINE_TAG:+-$ENGINE_TAG}-$TAG
    run "$name" "${ENGINE_TIMEOUT:-420}" "$PY" bench/engines/sglang_engine.py --model "$m" $quick \
      --timeout "${ENGINE_MODE_TIMEOUT:-150}" --json "$DEST/$name.json" ${ENGINE_ARGS:-}
  done
fi

step "summary"
cat "$DEST/sglang-steps-$TAG.txt"
ls -la "$DEST"
exit "$rc"
