#!/usr/bin/env bash
# vLLM 0.33 with hicache-cp as its host (L2) tier, a KV connector. hicache-cp must be importable
# by the Python that runs vLLM.
#   bash examples/vllm/serve.sh [more vLLM flags]           # MODEL=... picks another model
# kv_role kv_both: the connector saves and loads; kv_load_failure_policy recompute: a failed
# host-to-device copy is reported as invalid blocks and vLLM recomputes them.
# kv_connector_extra_config keys: docs/configuration.md ("Inside the engines").
set -euo pipefail
exec vllm serve "${MODEL:-deepseek-ai/DeepSeek-V3.2}" \
  --block-size 64 \
  --kv-transfer-config '{"kv_connector": "HiCacheConnector", "kv_connector_module_path": "hicache_cp.integrations.vllm", "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"host_budget_gib": 64}}' \
  "$@"
