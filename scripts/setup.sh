#!/usr/bin/env bash
# Create .venv with the project and everything its tests need, CPU only.
#
#   ./scripts/setup.sh                 # the library, the harness, the test peers (vLLM, SGLang)
#   HICACHE_PEERS=0 ./scripts/setup.sh # without vLLM and SGLang (their tests then skip)
#
# torch is installed pinned first: on these machines `torch==2.13.0` is a local
# CPU build, while an open range would pull a multi-GB CUDA build. vLLM and
# SGLang pin CUDA torches and GB-sized trees: their own scripts install them
# --no-deps with the few small packages their imports need (scripts/install_*.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  # Mooncake's TransferEngine loads libibverbs even for TCP (docs/platform.md).
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1) >/dev/null
  else
    echo "note: libibverbs1 is missing; PD (Mooncake) features and tests need it: apt-get install libibverbs1" >&2
  fi
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[test,pd,plot,hf,metrics]"
if [ "${HICACHE_PEERS:-1}" != 0 ]; then
  bash scripts/install_vllm.sh .venv/bin/python
  bash scripts/install_sglang.sh
fi
