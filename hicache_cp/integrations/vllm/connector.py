"""`HiCacheConnector`: hicache-cp as the host (L2) tier of a vLLM 0.33 server.

    vllm serve <model> --kv-transfer-config '{"kv_connector": "HiCacheConnector",
        "kv_connector_module_path": "hicache_cp.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"host_budget_gib": 64}}'

vLLM builds the connector twice, in two roles that may live in different
processes and share nothing but the per-step metadata vLLM carries:

    role        process                      class          holds
    SCHEDULER   engine core (the scheduler)  SchedulerSide  the HiCache: tree of host copies, L2
                                                            allocator, eviction, op state machines
                                                            (index only: no host memory there)
    WORKER      each GPU worker              WorkerSide     L1 = vLLM's KV tensors (views), the L2
                                                            host pool, the copy engine

The protocol of one engine step:

    scheduler  get_num_new_matched_tokens -> update_state_after_alloc -> build_connector_meta
                   (L2 lookups)                 (loads into vLLM blocks)   (loads + write-through saves)
    workers    start_load_kv -> [wait_for_layer_load(l) -> attention(l) -> save_kv_layer(l)]*
               -> wait_for_save -> get_block_ids_with_load_errors, build_connector_worker_meta
    scheduler  update_connector_output (verdicts -> commits / aborts) ... request_finished

vLLM's `KVCacheBlocks` and block hashes stay vLLM's: the cache keys pages by
their tokens (page size == block size), so requests whose KV is not a
function of their tokens (LoRA, multimodal, cache salt, prompt embeddings)
bypass L2. One KV cache group, no pipeline or decode-context parallelism;
tensor parallelism gives each worker its own L2 of its shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hicache_cp.integrations.vllm.metadata import HiCacheMetadata
from hicache_cp.integrations.vllm.plan import KVPlan
from hicache_cp.integrations.vllm.scheduler import SchedulerSide
from hicache_cp.integrations.vllm.settings import ConnectorSettings, node_settings
from hicache_cp.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class HiCacheConnector(KVConnectorBase_V1):
    """vLLM's KV connector over hicache-cp; see the module docstring."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        settings = ConnectorSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1 or getattr(parallel, "decode_context_parallel_size", 1) != 1:
            raise ValueError("hicache-cp's vLLM connector supports tensor parallelism only (no PP, no DCP)")
        if settings.node_segment:  # one copy for the node: the workers' KV must be the same (MLA)
            settings = node_settings(settings, vllm_config)
        layers = vllm_config.model_config.hf_text_config.num_hidden_layers
        plan = KVPlan.from_kv_cache_config(kv_cache_config, layers)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role is KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(plan, settings, parallel.world_size)
        else:
            self.worker_side = WorkerSide(plan, settings)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss, never lost output

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # per-layer waits and saves run between graph pieces

    # ---- scheduler role ---------------------------------------------------------------

    def _sched(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "a scheduler-role call on a worker-role connector"
        return self.scheduler_side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request)

    # ---- worker role ------------------------------------------------------------------

    def _work(self) -> WorkerSide:
        assert self.worker_side is not None, "a worker-role call on a scheduler-role connector"
        return self.worker_side

    def _meta(self) -> HiCacheMetadata | None:
        meta = self._connector_metadata
        assert meta is None or isinstance(meta, HiCacheMetadata), type(meta)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None:
            self._work().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        meta = self._meta()
        if meta is not None:
            self._work().save_kv_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        self._work().wait_for_save(self._meta())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._work().worker_meta()

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()
        if self.scheduler_side is not None:
            self.scheduler_side.close()
