#!/usr/bin/env bash
# Create .venv with the project and everything its tests need, CPU only.
# torch is installed pinned first: on these machines `torch==2.13.0` is a local
# CPU build, while an open range would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  # Mooncake's TransferEngine loads libibverbs even for TCP (PLATFORM.md).
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1) >/dev/null
  else
    echo "note: libibverbs1 is missing; PD (Mooncake) features and tests need it: apt-get install libibverbs1" >&2
  fi
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[test,pd,plot]"
