#!/usr/bin/env bash
# Install SGLang 0.5.23 into .venv, CPU only, without touching torch, numpy or
# transformers: the peer that bench-alloc (SGLang's HostKVCache allocator as
# shipped) and the L3 tier's SGLang storage-backend checks run against.
#
#   bash scripts/install_sglang.sh        # idempotent: a second run installs nothing
#
# sglang's wheel pins torch==2.14.1 and pulls GBs of CUDA packages, so it is
# installed with --no-deps, and so is each module its mem_cache imports need
# (pinned, each with --no-deps, so pip never resolves torch/numpy/transformers).
# Checked on the CPU torch 2.13.0 pin (2 cores, Python 3.11):
#   - `sglang/__init__` imports sglang.srt.utils, which imports triton at the
#     top: triton is the one large package here (about 1 GB unpacked).
#   - `sglang.srt.mem_cache.pool_host` (its package __init__) reaches
#     sglang.srt.configs, which imports torchvision. PyPI's torchvision is a
#     CUDA build whose ops do not load on the CPU torch, and an installed
#     torchvision that does not load breaks `transformers` imports for every
#     user of this venv: this script never installs it. The modules themselves
#     (pool_host/base.py: HostKVCache, hicache_storage.py, storage/backend_factory.py)
#     import fine; bench-alloc loads pool_host/base.py without running the
#     __init__ of `sglang` (it patches transformers and redirects cache
#     directories process-wide) or of pool_host, and says so in its JSON.
# Requires .venv (scripts/setup.sh). VENV=path overrides it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "install_sglang.sh: $PY not found; run scripts/setup.sh first" >&2
  exit 1
fi

PACKAGES=(
  sglang==0.5.23
  triton==3.9.0        # imported by sglang.srt.utils at module level
  orjson==3.13.0
  psutil==7.2.2
  pybase64==1.5.1
  starlette==1.10.0
  msgspec==0.23.0
  pyzmq==27.3.0
  ipython==9.18.1
  traitlets==5.16.1
  # imported by the scheduler-side modules the radix-cache plug-in runs against
  # (schedule_batch, schedule_policy, memory_pool through sglang.srt.configs and layers)
  dill==0.4.1
  sentencepiece==0.2.3
  compressed-tensors==0.20.1
  loguru==0.7.3
  gguf==0.19.0
  # imported by SGLang's engine and scheduler processes (bench/engines/sglang_pack.py traces them)
  setproctitle==1.3.8
  uvicorn==0.55.0
)

missing=()
for spec in "${PACKAGES[@]}"; do
  name=${spec%%==*}
  want=${spec##*==}
  have=$("$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print('')" "$name")
  [ "$have" = "$want" ] || missing+=("$spec")
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "install_sglang.sh: installing ${missing[*]} (--no-deps)"
  "$PY" -m pip install -q --no-deps "${missing[@]}"
else
  echo "install_sglang.sh: all ${#PACKAGES[@]} packages already installed"
fi

# Check what the project uses, and that the pins it must not move did not move.
"$PY" - <<'EOF'
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import numpy
import torch

from hicache_harness.sglang.env import import_sglang

import_sglang()  # sglang.srt.configs with the torchvision stand-in (hicache_harness/sglang/env.py)
base = importlib.import_module("sglang.srt.mem_cache.pool_host.base")
for name in ("sglang.srt.mem_cache.hicache_storage", "sglang.srt.mem_cache.storage.backend_factory"):
    importlib.import_module(name)
assert hasattr(base.HostKVCache, "alloc") and hasattr(base.HostKVCache, "free")
import sglang.srt.managers.schedule_policy  # noqa: F401 - the scheduler functions the plug-in's tests drive
import sglang.srt.mem_cache.memory_pool  # noqa: F401
print(f"install_sglang.sh: ok: sglang {importlib.metadata.version('sglang')} mem_cache imports "
      f"(torch {torch.__version__}, numpy {numpy.__version__})")
EOF
