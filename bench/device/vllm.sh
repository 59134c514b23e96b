#!/usr/bin/env bash
# On a GPU host (vLLM not installed there): vLLM 0.33.0's Python sources (no compiled parts) on the
# image's torch 2.11 / Python 3.12, and the vLLM connector's tests on CUDA under vLLM's real
# Scheduler. Prepare here, then one device call:
#
#   .venv/bin/python bench/engines/vllm_pack.py                       # here: .vllm/ (sources + wheels, ~28 MiB)
#   HICACHE_COMMIT=<hash> bash bench/device/vllm.sh           # there, with .vllm/ beside the tree
#
# Steps (each logged to $DEST/vllm-$GPU.log, which starts with commit, machine and command):
#   setup    the wheels of .vllm/whl into $SITE (pip --no-index --no-deps), vllm-src.tar.gz over it
#   import   python3 -c: torch, vllm, the platform vLLM picked, the scheduler and connector imports
#   tests    pytest tests/test_vllm_*.py (cpu and cuda parametrisations) -> JUnit -> $DEST/vllm-$GPU.json
#   llm      bench/engines/vllm_llm_try.py: vllm.LLM offline on a tiny random model -> $DEST/vllm-llm-$GPU.json
# STEPS="import tests llm" by default. Exit status: the tests'.
set -uo pipefail
cd "$(dirname "$0")/../.."
SITE=${SITE:-/tmp/vllm-site}
DEFAULT_STEPS="import tests llm"
source bench/device/env.sh
export HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
LOG=$DEST/vllm-$GPU.log
{
header "STEPS=\"$STEPS\" bash bench/device/vllm.sh"
step setup
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .vllm/whl/*.whl || exit 3
tar -xzf .vllm/vllm-src.tar.gz -C "$SITE" || exit 3
export PYTHONPATH=$PWD:$SITE
python3 -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|numpy|triton|huggingface.hub|tokenizers) " || true
jq -c '.vllm | {version, files, tarball_bytes, shims}' .vllm/manifest.json 2>/dev/null || head -c 600 .vllm/manifest.json

rc=0
if want import; then
  step "import vLLM on the image's torch"
  python3 - <<'PY' 2>&1 | tee "$DEST/vllm-import.txt"
import json, sys, torch, time
t = time.perf_counter()
import vllm
from vllm.platforms import current_platform
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: F401
import hicache_cp.integrations.vllm as hv
print(json.dumps({"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                  "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "vllm": vllm.__version__, "vllm_from": vllm.__file__,
                  "platform": type(current_platform).__name__, "connector": hv.HiCacheConnector.__module__,
                  "import_s": round(time.perf_counter() - t, 2)}))
PY
fi

if want tests; then
  step "the vLLM connector's tests (cpu and cuda)"
  cmd="python3 -m pytest -q -p no:cacheprovider -rfEs -o junit_family=xunit1 --junitxml=$DEST/vllm-junit.xml tests/test_vllm_connector.py tests/test_vllm_plan.py tests/test_vllm_engine_l1.py tests/test_vllm_compare.py"
  echo "\$ $cmd"
  timeout "${TESTS_TIMEOUT:-330}" $cmd 2>&1 | tail -150
  rc=${PIPESTATUS[0]}
fi

if want llm; then
  step "vllm.LLM offline, tiny random model (item 2)"
  timeout "${LLM_TIMEOUT:-150}" python3 bench/engines/vllm_llm_try.py --json "$DEST/vllm-llm-$GPU.json" 2>&1 | tail -60
fi

step report
python3 bench/engines/vllm_device_report.py --junit "$DEST/vllm-junit.xml" --log "$LOG" --json "$DEST/vllm-$GPU.json" \
  --command "STEPS=\"$STEPS\" bash bench/device/vllm.sh" --extra "llm=$DEST/vllm-llm-$GPU.json"
echo "tests exit $rc"
exit $rc
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
