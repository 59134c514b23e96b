"""hicache-cp as the host tier of a vLLM 0.33 server: a KV connector.

Loaded by vLLM from `--kv-transfer-config` (see `connector.py` and docs/integrations/vllm.md):

    {"kv_connector": "HiCacheConnector", "kv_connector_module_path": "hicache_cp.integrations.vllm",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"host_budget_gib": 64}}

    connector   HiCacheConnector (KVConnectorBase_V1): dispatches to the side of its role
    scheduler   SchedulerSide: the cache's decisions (scheduler process)
    worker      WorkerSide: L1 views of vLLM's tensors, L2, per-layer copies (each worker)
    plan        KVCacheConfig -> KVLayout, layer names -> (part, layer), page-major views
    metadata    per-step jobs (scheduler -> workers) and verdicts (workers -> scheduler)
    remote      the scheduler's copy engine, whose tickets the workers' verdicts resolve
    settings    kv_connector_extra_config

Importing this package imports vLLM (`scripts/install_vllm.sh` installs it).
"""

from hicache_cp.integrations.vllm.connector import HiCacheConnector

__all__ = ["HiCacheConnector"]
