#!/usr/bin/env bash
# The real-model prefill server on one GPU, about 3-4 minutes on an H200.
#
# DeepSeek-V3.2 at its real widths (transformers 5.20, bf16, seeded random weights,
# 4 dense layers + the MTP draft layer, index top-k above every prompt), batched and
# chunked, with hicache-cp as its L2; prompts of 8k-19k tokens (the embedded
# workload's requests of >= 16 blocks at 512 tokens a block, the block of the
# Mooncake trace format), arriving at their trace timestamps (x TIME_SCALE); L1
# of 400 pages (1.35x the longest prompt) makes L2 matter. PyTorch's allocator
# runs with expandable segments: every request brings tensors of new sizes.
#
#   serve  $DEST/serve-$GPU.json     both oracles, TTFT p50/p90/p99, >= 90%-hit requests:
#                                    TTFT over recompute and load time over the PCIe bound,
#                                    the same trace with L2 off (--compare-no-l2), and PROBE
#                                    (default 8) L2-hit/L1-hit TTFT pairs and layer times
#                                    with and without copies in flight (--ttft-probe)
#   pd     $DEST/serve-pd-$GPU.json  --pd: every request's KV to a decode peer process
#                                    (Mooncake on GPU memory), every unit verified there
#                                    against the digests prefill recorded
#
# Needs transformers 5.20 (the 5.17 release keeps DeepSeek-V3.2's keys expanded, 70x the
# bytes) and Mooncake's CUDA build (mooncake-transfer-engine-cuda13 for CUDA 13): installed,
# or as wheels in .whl/ (not committed) for a host without network. From the repository root:
#   bash bench/device/serve.sh            # STEPS="serve pd" by default
# A CPU rehearsal of the script's mechanics (no wheels, the tiny model):
#   WHEELS=0 PRESET=tiny DEVICE=cpu TPB=64 PYTHON=.venv/bin/python OUT=/tmp/serve bash bench/device/serve.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
DEFAULT_STEPS="serve pd"
source bench/device/env.sh
wheels "${WHEEL_GLOB:-.whl/*.whl}" || exit 1
export MC_LOG_LEVEL=ERROR PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
LIMIT=${LIMIT:-50}
PD_LIMIT=${PD_LIMIT:-25}
TIME_SCALE=${TIME_SCALE:-1.0}
TRACE=.devdata/serve-6k.jsonl
PRESET=${PRESET:-dsv32-width}
DEVICE=${DEVICE:-cuda}
TPB=${TPB:-512}
L1_PAGES=${L1_PAGES:-400}
SCHEDULE=${SCHEDULE:-short-first}
mkdir -p .devdata

step versions
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" || exit 1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv

$PY - "$TRACE" <<'EOF' || exit 1
import sys
from hicache_harness.trace import write_trace
from hicache_harness.workload import default_workload
long = [r for r in default_workload(seed=0) if r.full_blocks >= 16]  # >= 8192 tokens at 512 a block
write_trace(sys.argv[1], long)
print(f"{len(long)} requests of >= 16 blocks -> {sys.argv[1]}")
EOF

# L2 half the footprint.
COMMON=(--engine hf --hf-preset "$PRESET" --device "$DEVICE" --trace "$TRACE" --tokens-per-block "$TPB"
        --l2-fraction 0.5 --l1-pages "$L1_PAGES" --arrivals trace --time-scale "$TIME_SCALE" --schedule "$SCHEDULE")

if want serve; then
  step "serve: dsv32-width with L2, then L2 off; byte and output oracles"
  timeout 330 $PY -m hicache_harness.cli replay "${COMMON[@]}" --limit "$LIMIT" --check-outputs 8 \
    --recompute-samples 8 --compare-no-l2 --ttft-probe "${PROBE:-8}" --json "$DEST/serve-$GPU.json" 2>&1 | grep -v "hf replay:" | tail -45
fi

if want pd; then
  step "pd: the same server shipping every request's KV to a decode peer (Mooncake, GPU memory)"
  timeout 200 $PY -m hicache_harness.cli replay "${COMMON[@]}" --limit "$PD_LIMIT" --pd \
    --json "$DEST/serve-pd-$GPU.json" 2>&1 | grep -v "hf replay:" | tail -30
fi

step summary
$PY - "$DEST" "$GPU" <<'EOF2'
import json, pathlib, sys
keys = ("requests", "served_requests", "hit_rate", "l2_hit_tokens", "max_batch_requests", "ttft_p50_s", "ttft_p90_s",
        "ttft_p99_s", "prefill_tokens_per_s", "prefill_compute_saved", "hit90_requests", "ttft_hit_over_recompute",
        "ttft_hit_over_recompute_p90", "hit90_loads", "load_over_pcie_bound", "load_over_pcie_bound_p90", "copy_peak_gbps",
        "integrity_checked_units", "integrity_expected_units", "integrity_mismatches", "outputs_checked",
        "outputs_max_abs_err", "outputs_mismatches", "outputs_same_argmax", "pd_rooms", "pd_failed_rooms",
        "pd_mismatches", "pd_gbps", "integrity_failures", "ttft_l2_over_l1_hit", "ttft_l2_over_l1_hit_p90",
        "ttft_probe_pairs", "ttft_probe_valid_pairs", "ttft_probe_error", "ttft_probe_wall_s", "layer_forward_ms")
for name in (f"serve-{sys.argv[2]}.json", f"serve-pd-{sys.argv[2]}.json"):
    path = pathlib.Path(sys.argv[1]) / name
    if path.is_file():
        r = json.loads(path.read_text())
        print(name, {k: r[k] for k in keys if k in r})
        if "no_l2" in r:
            print("  no_l2", {k: r["no_l2"][k] for k in ("hit_rate", "ttft_p50_s", "ttft_p90_s", "prefill_compute_saved")})
        if "pd" in r:
            print("  decode peer", r["pd"])
EOF2
