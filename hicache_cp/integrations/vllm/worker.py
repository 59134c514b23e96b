"""The worker-process side of the connector: the bytes.

Runs in: every vLLM worker (one per GPU), once per engine step, inside the
forward. vLLM's paged KV tensors become the L1 `DevicePool` (page-major
uint8 views, no copy); the L2 `HostPool` (pinned where CUDA is) and the copy
engine live here. The worker makes no decision: it runs the scheduler's jobs
(`HiCacheMetadata`) with the cache's own op types, per layer:

    start_load_kv          every load job: `LoadOp`, H2D of every layer of every part submitted
                           in forward order on the copy engine's H2D stream
    wait_for_layer_load(l) the forward waits for layer l (`LoadOp.wait_layer`; on CUDA the
                           compute stream waits on the layer's event, the host does not block)
    save_kv_layer(l)       every save job: `BackupOp`, D2H of layer l once attention wrote it
    wait_for_save          layers whose hook never fired are copied now (warned once), then
                           every copy of the step is waited for: blocks vLLM frees after this
                           step can be reused at once
    get_block_ids_with_load_errors / build_connector_worker_meta
                           failed loads as vLLM's invalid blocks (its recompute path), and
                           every job's verdict for the scheduler (commit or abort)

Parts read before their layer's hook: the MLA indexer's cache (Part.TARGET_STATE)
of layer l is read by layer l's indexer before layer l's attention, so it is
waited for at layer l-1's hook (layer 0's at `start_load_kv`); draft parts
are waited for at the last target layer's hook.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from hicache_cp import BackupOp, BackupState, DevicePool, HostPool, LoadOp, LoadState, Model, Part
from hicache_cp.cache.node_tier import NodeTier
from hicache_cp.cp.agreement import LocalAgreement
from hicache_cp.integrations.vllm.metadata import CopyJob, HiCacheMetadata, HiCacheWorkerMetadata
from hicache_cp.integrations.vllm.plan import KVPlan
from hicache_cp.integrations.vllm.settings import ConnectorSettings
from hicache_cp.io.base import CopyEngine, make_engine

logger = logging.getLogger(__name__)

_STATE_OF = {Model.TARGET: Part.TARGET_STATE, Model.DRAFT: Part.DRAFT_STATE}


class WorkerSide:
    """The worker role of `HiCacheConnector`; see the module docstring."""

    def __init__(self, plan: KVPlan, settings: ConnectorSettings) -> None:
        self.plan = plan
        self.settings = settings
        self.node: NodeTier | None = None
        self.config = settings.cache_config(plan.layout)
        self.layout = self.config.layout()
        self.device_pool: DevicePool | None = None
        self.host_pool: HostPool | None = None
        self.engine: CopyEngine | None = None
        self._loads: list[tuple[CopyJob, LoadOp]] = []
        self._saves: dict[int, tuple[CopyJob, BackupOp]] = {}
        self._results: dict[int, tuple[int, str | None]] = {}
        self._load_errors: set[int] = set()
        self._warned_fallback = False

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """vLLM's tensors become L1 (views); L2 and the copy engine are made here."""
        buffers = self.plan.device_buffers(kv_caches)
        self.device_pool = DevicePool(self.layout, self.plan.num_blocks, buffers=buffers)
        if self.config.node_segment:  # the node's one copy (every worker writes each save, alike)
            self.node = NodeTier(self.config, self.layout, LocalAgreement(), self.config.host_budget_bytes,
                                 session=self.settings.node_session, writer=False)  # fmt: skip
            self.host_pool = self.node.host_pool(self.config.pin_host)
        else:
            self.host_pool = HostPool(self.layout, self.config.host_budget_bytes, pin=self.config.pin_host)
        self.engine = make_engine(self.config.io_backend, self.device_pool, self.host_pool)
        logger.info(
            "hicache-cp worker: L1 = vLLM's %d blocks (%s), L2 = %d pages (%.1f MiB, %s), io %s",
            self.plan.num_blocks, self.layout.describe(), self.host_pool.physical_pages,
            self.host_pool.split.used_bytes / 2**20, "pinned" if self.host_pool.pinned else "plain", self.engine.name,
        )

    # ---- loads --------------------------------------------------------------------------

    def start_load_kv(self, meta: HiCacheMetadata) -> None:
        engine = self._engine(meta)
        for job in meta.loads:
            op = LoadOp(self.layout, job.device_pages, job.host_pages, job.first_position)
            for model in (Model.TARGET, Model.DRAFT):
                for layer in range(self.layout.num_layers(model)):
                    for part in op.layers_to_submit(model, layer):
                        ticket = engine.submit_load(part, layer, job.host_pages, job.device_pages)
                        op.record_submit(part, layer, [ticket])
            op.transition(LoadState.LOADING)
            self._loads.append((job, op))
        if self._loads and self.layout.num_target_layers:
            self._wait_part(Part.TARGET_STATE, 0)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loads:
            return
        where = self.plan.slot(layer_name)
        last_target = where.model is Model.TARGET and where.layer == self.layout.num_target_layers - 1
        for _, op in self._loads:
            op.wait_layer(where.layer, where.model)
        self._wait_part(_STATE_OF[where.model], where.layer + 1)
        if last_target:
            for layer in range(self.layout.num_draft_layers):
                for _, op in self._loads:
                    op.wait_layer(layer, Model.DRAFT)

    def _wait_part(self, part: Part, layer: int) -> None:
        if not self.layout.has_part(part) or not self.layout.part(part).has_layer(layer):
            return
        for _, op in self._loads:
            op.wait_part(part, layer)

    # ---- saves --------------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, meta: HiCacheMetadata) -> None:
        if not meta.saves:
            return
        where = self.plan.slot(layer_name)
        if where.part in (Part.TARGET_STATE, Part.DRAFT_STATE):
            return  # copied with its attention layer, whose hook comes after the indexer wrote it
        for job in meta.saves:
            self._submit_save(job, where.model, where.layer)

    def _submit_save(self, job: CopyJob, model: Model, layer: int) -> BackupOp:
        engine = self._engine(None)
        entry = self._saves.get(job.job_id)
        if entry is None:
            op = BackupOp(self.layout, job.device_pages, job.host_pages, job.first_position, layerwise=True)
            self._saves[job.job_id] = entry = (job, op)
        op = entry[1]
        for part in op.layers_to_submit(model, layer):
            op.record_submit(part, layer, [engine.submit_backup(part, layer, job.device_pages, job.host_pages)])
            if op.state is BackupState.RESERVED:
                op.transition(BackupState.WRITING)
        return op

    def wait_for_save(self, meta: HiCacheMetadata | None) -> None:
        """Copy layers no hook reported, then wait for every copy of the step."""
        for job in meta.saves if meta is not None else ():
            entry = self._saves.get(job.job_id)
            missing = entry[1].missing_layers() if entry is not None else "every layer"
            if not missing:
                continue
            if not self._warned_fallback:
                logger.warning(
                    "hicache-cp worker: no save_kv_layer hook for %s of job %d; copied after the forward "
                    "(not overlapped with it; warned once)", missing, job.job_id,
                )
                self._warned_fallback = True
            for model in (Model.TARGET, Model.DRAFT):
                for layer in range(self.layout.num_layers(model)):
                    self._submit_save(job, model, layer)
        self._finish_saves()
        self._finish_loads()

    def _finish_saves(self) -> None:
        for job, op in self._saves.values():
            self._record(job, op)
        self._saves.clear()

    def _finish_loads(self) -> None:
        for job, op in self._loads:
            if not self._record(job, op):
                self._load_errors.update(int(b) for b in job.device_pages)
        self._loads.clear()

    def _record(self, job: CopyJob, op: LoadOp | BackupOp) -> bool:
        """Wait for the op's copies; record the verdict for the scheduler. Returns ok."""
        for t in op.inflight:
            try:
                t.wait()
            except Exception as exc:  # the verdict below carries it
                op.error = op.error or exc
        vote = op.local_vote()
        error = None if vote.ok and vote.settled else str(op.error or "not every layer of every part landed")
        if error is not None:
            logger.warning("hicache-cp worker: %s job %d of %s failed: %s", op.kind, job.job_id, job.req_id, error)
        self._results[job.job_id] = (1, error)
        return error is None

    # ---- reports ------------------------------------------------------------------------

    def block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()  # normally done by wait_for_save; a deferred finalize comes later
        errors, self._load_errors = self._load_errors, set()
        return errors

    def worker_meta(self) -> HiCacheWorkerMetadata | None:
        if not self._results:
            return None
        results, self._results = self._results, {}
        return HiCacheWorkerMetadata(results)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.host_pool is not None:
            self.host_pool.close()
        if self.node is not None:
            self.node.close()

    def _engine(self, meta: HiCacheMetadata | None) -> CopyEngine:
        if self.engine is None or self.host_pool is None:
            raise RuntimeError("hicache-cp worker: copies requested before register_kv_caches")
        if meta is not None and meta.layout and meta.layout != self.layout.describe():
            raise ValueError(
                f"the scheduler's KV layout ({meta.layout}) differs from this worker's ({self.layout.describe()}): "
                f"the two processes read vLLM's KV cache config differently"
            )
        if meta is not None and meta.host_pages != self.host_pool.physical_pages:
            raise ValueError(
                f"the scheduler allocates from {meta.host_pages} L2 pages but this worker holds "
                f"{self.host_pool.physical_pages}: host budget or KV layout differ between the processes"
            )
        return self.engine

