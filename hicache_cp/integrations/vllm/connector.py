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
    workers    handle_preemptions -> start_load_kv -> [wait_for_layer_load(l) -> attention(l)
               -> save_kv_layer(l)]* -> wait_for_save -> get_finished,
               get_block_ids_with_load_errors, build_connector_worker_meta
    scheduler  update_connector_output (verdicts -> commits / aborts) ... request_finished

Costs it does not impose on vLLM:
- CUDA graphs: vLLM's default (full decode graphs, piecewise prefill) is kept. A
  full-graph replay runs no layer hook: its loads are waited for by the compute
  stream before the replay, its saves submitted after it (`worker.py`).
- Saves never block the host: their verdicts arrive in a later step, and a
  finished request whose saves are still in flight keeps its blocks until every
  worker reports it through `get_finished` (vLLM's asynchronous completion path).
  A step's loads are waited for at its end, so failures reach vLLM's recompute
  path in that step.
- The hybrid KV cache manager stays on (`SupportsHMA`); models it splits into
  several KV cache groups are refused at start (`plan.py` says why).

KV events: with vLLM's `--kv-events-config`, the scheduler side's L2 (and
L3) blocks go out through `take_events`, in vLLM's format and keyed with its
block hashes (`events.py`, docs/events.md). Metrics: both roles report
through vLLM's KV connector stats, which vLLM serves on its own /metrics as
`vllm:hicache_*` (`stats.py`).

vLLM's `KVCacheBlocks` and block hashes stay vLLM's: the cache keys pages by
their tokens (page size == block size), so a request for which vLLM adds any
extra key to its block hashes (LoRA adapter, multimodal input, cache salt,
prompt embeddings) bypasses L2. No pipeline or decode-context parallelism;
tensor parallelism gives each worker its own L2 of its shard (with MLA, whose
KV vLLM replicates on every rank, each worker keeps its own copy).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import CUDAGraphMode
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hicache_cp.integrations.vllm.events import VLLMEncoder, connector_log
from hicache_cp.integrations.vllm.metadata import HiCacheMetadata
from hicache_cp.integrations.vllm.plan import KVPlan
from hicache_cp.integrations.vllm.scheduler import SchedulerSide
from hicache_cp.integrations.vllm.settings import ConnectorSettings, node_settings
from hicache_cp.integrations.vllm.stats import HiCachePromMetrics, HiCacheStats
from hicache_cp.integrations.vllm.worker import WorkerSide

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class HiCacheConnector(KVConnectorBase_V1, SupportsHMA):
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
        self._events = VLLMEncoder(clear_as_removals=True)  # a clear must not wipe vLLM's GPU blocks
        if role is KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(plan, settings, parallel.world_size, connector_log(vllm_config))
        else:
            self.worker_side = WorkerSide(plan, settings)
            if plan.replicated and parallel.tensor_parallel_size > 1:
                logger.info(
                    "hicache-cp: vLLM replicates this model's MLA KV on each of its %d TP ranks; each worker "
                    "keeps its own host copy (host_budget is per worker)", parallel.tensor_parallel_size,
                )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss, never lost output

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return False  # a full-graph replay is handled without layer hooks (module docstring)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return KVPlan.PREFERRED_LAYOUT  # page-major for every attention backend that takes it

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

    def take_events(self) -> list[KVCacheEvent]:
        """L2/L3 KV events since the last step, in vLLM's format (vLLM publishes them with its own)."""
        side = self.scheduler_side
        if side is None or side.events is None:
            return []
        return self._events.encode_all(side.events.take())

    def reset_cache(self) -> bool:
        return self._sched().reset()

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
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

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, HiCacheMetadata), type(kv_connector_metadata)
        self._work().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None:
            self._work().start_load_kv(meta, layer_hooks=_layer_hooks_run(forward_context))

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

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work().finished_sending() or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._work().worker_meta()

    # ---- metrics (both roles; vLLM sums them and exports them in its own process) ---------

    def get_kv_connector_stats(self) -> HiCacheStats | None:
        side = self.scheduler_side or self.worker_side
        return side.metrics_report() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HiCacheStats:
        return HiCacheStats(data={} if data is None else data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> HiCachePromMetrics:  # fmt: skip
        return HiCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()
        if self.scheduler_side is not None:
            self.scheduler_side.close()


def _layer_hooks_run(forward_context: ForwardContext | None) -> bool:
    """Whether the forward about to run calls the per-layer hooks. vLLM's attention
    wrapper skips them without attention metadata in the forward context (the V2
    runner starts loads outside it before a full-graph replay), and a full-graph
    replay runs no Python at all."""
    if forward_context is None or forward_context.attn_metadata is None:
        return False
    return forward_context.cudagraph_runtime_mode != CUDAGraphMode.FULL
