#!/usr/bin/env bash
# Per-layer PD on one GPU: the time from the forward's end to the decode peer holding all of
# a request's KV, per-layer against after-insert sending, in about 2-4 minutes.
#
#   overlap  $DEST/pd-overlap-$GPU-<layer_ms>ms.json   bench-pd --overlap: a DeepSeek-V3.2-like
#            layout (61 target layers with NSA state on every layer + 1 MTP draft layer,
#            656 + 132 B a token a layer, page 64), 128 pages (8k tokens), half of them L2-only;
#            L1 in GPU memory; a stand-in forward of LAYER_MS per layer (bf16 matmuls on the
#            compute stream, calibrated); per_layer submits each layer from its hook once the
#            layer's CUDA event completes, after_insert sends everything after the forward's
#            sync. Every byte of every run verified by the decode peer.
#   replay   $DEST/pd-replay-$GPU-{after-insert,per-layer}.json   replay --pd --device cuda on
#            the embedded workload (the synthetic engine's KV generated on the GPU), per-layer
#            off and on: 0 mismatches, every room verified, pd_ready_s_p50/p90 per room.
#   serve    $DEST/pd-serve-$GPU-{after-insert,per-layer}.json   the real-width DeepSeek-V3.2
#            server of bench/device/serve.sh (hf engine, 4 layers + MTP, 8-19k-token prompts,
#            batched and chunked) with --pd, per-layer off and on: pd_ready_s_* is the real
#            forward's end to the decode peer holding all KV; every unit checked against digests.
#
# Needs Mooncake's CUDA build (mooncake-transfer-engine-cuda13 for CUDA 13) and, for `serve`,
# transformers 5.20: installed, or as wheels in .whl/ (not committed). From the repository root:
#   bash bench/device/pd.sh                # STEPS="overlap replay serve"
# The same on CPU loopback (no wheels; the venv's non-CUDA Mooncake; forward = a wait):
#   STEPS="overlap replay" WHEELS=0 DEVICE=cpu PYTHON=.venv/bin/python OUT=/tmp/pd bash bench/device/pd.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
DEFAULT_STEPS="overlap replay serve"
source bench/device/env.sh
wheels "${WHEEL_GLOB:-.whl/*.whl}" || exit 1
export MC_LOG_LEVEL=ERROR
DEVICE=${DEVICE:-cuda}
SUFFIX=${SUFFIX:-$([ "$DEVICE" = cpu ] && echo cpu || echo "$GPU")}
PAGES=${PAGES:-128}
LAYER_MS=${LAYER_MS:-5 28}   # 28 ms: a real-width V3.2 layer at 4k tokens on an H200 (docs/bench/pd.md)
REPEATS=${REPEATS:-5}
LIMIT=${LIMIT:-300}
PD_LIMIT=${PD_LIMIT:-25}
PRESET=${PRESET:-dsv32-width}
TPB=${TPB:-512}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

step versions
$PY -c "import torch, mooncake.engine; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'mooncake', mooncake.engine.__file__)" || exit 1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv

if want overlap; then
  for ms in $LAYER_MS; do
    step "overlap: $PAGES pages, 62 layers x $ms ms on $DEVICE"
    timeout 300 $PY -m hicache_harness.cli bench-pd --overlap --device "$DEVICE" --pages "$PAGES" \
      --num-layers 61 --state-layers all --layer-ms "$ms" --repeats "$REPEATS" \
      --json "$DEST/pd-overlap-$SUFFIX-${ms}ms.json" 2>&1 | grep -v "^E[0-9]\{4\} \|^WARNING: Logging" | tail -6 || rc=1
  done
fi

if want replay; then
  for mode in after-insert per-layer; do
    step "replay --pd on the embedded workload, $mode, --device $DEVICE"
    flag=$([ "$mode" = per-layer ] && echo --pd-per-layer || true)
    timeout 300 $PY -m hicache_harness.cli replay --pd $flag --device "$DEVICE" --limit "$LIMIT" \
      --json "$DEST/pd-replay-$SUFFIX-$mode.json" 2>&1 | grep -E "pd_|integrity|hit_rate|error" | head -30 || rc=1
  done
fi

if want serve; then
  TRACE=.devdata/serve-6k.jsonl
  mkdir -p .devdata
  $PY - "$TRACE" <<'EOF2' || exit 1
import sys
from hicache_harness.trace import write_trace
from hicache_harness.workload import default_workload
long = [r for r in default_workload(seed=0) if r.full_blocks >= 16]  # >= 8192 tokens at 512 a block
write_trace(sys.argv[1], long)
EOF2
  for mode in after-insert per-layer; do
    step "serve: $PRESET on $DEVICE with --pd, $mode"
    flag=$([ "$mode" = per-layer ] && echo --pd-per-layer || true)
    timeout 240 $PY -m hicache_harness.cli replay --engine hf --hf-preset "$PRESET" --device "$DEVICE" \
      --trace "$TRACE" --tokens-per-block "$TPB" --l2-fraction 0.5 --l1-pages 400 --arrivals trace \
      --limit "$PD_LIMIT" --pd $flag --json "$DEST/pd-serve-$SUFFIX-$mode.json" 2>&1 \
      | grep -v "hf replay:" | grep -E "pd_|integrity|ttft|error" | head -30 || rc=1
  done
fi

step summary
$PY - "$DEST" "$SUFFIX" <<'EOF'
import json, pathlib, sys
dest, suffix = pathlib.Path(sys.argv[1]), sys.argv[2]
for path in sorted(dest.glob(f"pd-overlap-{suffix}-*ms.json")):
    r = json.loads(path.read_text())
    print(path.name, {k: r[k] for k in ("ready_s_median", "forward_s_median", "ratio_per_layer_over_after_insert",
                                        "bytes", "layer_ms", "device", "commit")})
for path in [dest / f"pd-{kind}-{suffix}-{mode}.json" for kind in ("replay", "serve")
             for mode in ("after-insert", "per-layer")]:
    if path.is_file():
        r = json.loads(path.read_text())
        x = r["per_rank"][0]
        print(path.name, {"integrity_failures": r.get("integrity_failures"), "verified": r["pd"]["decode_verified_rooms"],
                          **{k: x.get(k) for k in ("pd_rooms", "pd_failed_rooms", "pd_mismatches", "pd_tail_pages",
                                                   "pd_ready_s_p50", "pd_ready_s_p90", "pd_per_layer")}})
EOF
exit $rc
