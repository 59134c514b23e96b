"""The worker-process side of the connector: the bytes.

Runs in: every vLLM worker (one per GPU), once per engine step, inside the
forward. vLLM's paged KV tensors become the L1 `DevicePool` (page-major
uint8 views, no copy); the L2 `HostPool` (pinned where CUDA is) and the copy
engine live here. The worker makes no decision: it runs the scheduler's jobs
(`HiCacheMetadata`) with the cache's own op types, per layer:

    handle_preemptions     saves of requests vLLM preempted this step are waited for (their
                           blocks are free and this step may write them); rare, host-blocking
    start_load_kv          every load job: `LoadOp`, H2D of every layer of every part submitted
                           in forward order on the copy engine's H2D stream. When no layer hook
                           will run (a full CUDA-graph replay), the compute stream waits for
                           every layer here instead (no host block)
    wait_for_layer_load(l) the forward waits for layer l (`LoadOp.wait_layer`; on CUDA the
                           compute stream waits on the layer's event, the host does not block)
    save_kv_layer(l)       every save job: `BackupOp`, D2H of layer l once attention wrote it
    wait_for_save          layers whose hook never fired are submitted now, after the forward
                           (a full CUDA-graph replay runs no hook: expected, DEBUG; some hooks
                           but not all: WARNING once). Never waits: saves complete
                           asynchronously and are reported when they have
    get_finished           finished requests vLLM keeps the blocks of (`delayed`) once none of
                           their saves is in flight here
    get_block_ids_with_load_errors
                           the step's loads are waited for (host) and the failed ones
                           reported as vLLM's invalid blocks (its recompute path), in the
                           step that ran them, in both of vLLM's step orders
    build_connector_worker_meta
                           the verdict of every job that settled: loads of this step, saves
                           of this or earlier steps (non-blocking query)

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
from hicache_cp import NodeTier
from hicache_cp import LocalAgreement
from hicache_cp.integrations.vllm.metadata import CopyJob, HiCacheMetadata, HiCacheWorkerMetadata
from hicache_cp.integrations.vllm.plan import KVPlan
from hicache_cp.integrations.vllm.settings import ConnectorSettings
from hicache_cp import Verify
from hicache_cp import CopyEngine, make_engine

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
        self._saves: dict[int, tuple[CopyJob, BackupOp]] = {}  # submitted, verdict not recorded yet
        self._sealed: set[int] = set()  # saves whose every layer was submitted (`wait_for_save` ran)
        self._delayed: set[str] = set()  # finished requests vLLM keeps the blocks of for us
        self._absorbed: HiCacheMetadata | None = None  # the step metadata whose `delayed` is in
        self._results: dict[int, tuple[int, str | None]] = {}
        self._load_errors: set[int] = set()
        self._warned_fallback = False

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """vLLM's tensors become L1 (views); L2 and the copy engine are made here."""
        buffers = self.plan.device_buffers(kv_caches)
        self.device_pool = DevicePool(self.layout, self.plan.num_blocks, buffers=buffers)
        checked = self.config.verify_restores is not Verify.OFF  # restored pages are checked here (io.verify)
        if self.config.node_segment:  # the node's one copy (every worker writes each save, alike)
            self.node = NodeTier(self.config, self.layout, LocalAgreement(), self.config.host_budget_bytes,
                                 session=self.settings.node_session, writer=False)  # fmt: skip
            self.host_pool = self.node.host_pool(self.config.pin_host)
        else:
            self.host_pool = HostPool(self.layout, self.config.host_budget_bytes, pin=self.config.pin_host,
                                      checksums=checked)  # fmt: skip
        self.engine = make_engine(self.config.io_backend, self.device_pool, self.host_pool)
        self.engine.verify = self.config.verify_restores
        logger.info(
            "hicache-cp worker: L1 = vLLM's %d blocks (%s), L2 = %d pages (%.1f MiB, %s), io %s",
            self.plan.num_blocks, self.layout.describe(), self.host_pool.physical_pages,
            self.host_pool.split.used_bytes / 2**20, "pinned" if self.host_pool.pinned else "plain", self.engine.name,
        )

    # ---- loads --------------------------------------------------------------------------

    def handle_preemptions(self, meta: HiCacheMetadata) -> None:
        """Wait (host) for the saves of requests preempted this step: vLLM freed their
        blocks at scheduling and this step's writes may reuse them. Rare."""
        self._absorb(meta)
        if not meta.preempted or not self._saves:
            return
        preempted = set(meta.preempted)
        for job_id, (job, op) in list(self._saves.items()):
            if job.req_id in preempted:
                self._record(job, op, block=True)
                del self._saves[job_id]
                self._sealed.discard(job_id)

    def start_load_kv(self, meta: HiCacheMetadata, layer_hooks: bool = True) -> None:
        """Submit every load of the step. `layer_hooks`: the forward will call
        `wait_for_layer_load` per layer; when it will not (a full CUDA-graph replay),
        the compute stream waits for every layer of every load here."""
        engine = self._engine(meta)
        self._absorb(meta)
        for job in meta.loads:
            op = LoadOp(self.layout, job.device_pages, job.host_pages, job.first_position)
            for model in (Model.TARGET, Model.DRAFT):
                for layer in range(self.layout.num_layers(model)):
                    for part in op.layers_to_submit(model, layer):
                        ticket = engine.submit_load(part, layer, job.host_pages, job.device_pages)
                        op.record_submit(part, layer, [ticket])
            op.transition(LoadState.LOADING)
            self._loads.append((job, op))
        if not self._loads:
            return
        if not layer_hooks:
            for _, op in self._loads:
                for model in (Model.TARGET, Model.DRAFT):
                    for layer in range(self.layout.num_layers(model)):
                        op.wait_layer(layer, model)
            logger.debug("hicache-cp worker: no layer hooks this step; the forward waits for %d loads up front",
                         len(self._loads))
        elif self.layout.num_target_layers:
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
        """Submit the layers no hook reported, after the forward wrote them. Never waits."""
        for job in meta.saves if meta is not None else ():
            entry = self._saves.get(job.job_id)
            missing = entry[1].missing_layers() if entry is not None else None
            if entry is not None and not missing:
                continue
            if entry is None:  # no hook fired for this job: a full CUDA-graph replay (or no layer hook at all)
                logger.debug("hicache-cp worker: job %d saved after the forward (no layer hook ran)", job.job_id)
            elif not self._warned_fallback:
                logger.warning(
                    "hicache-cp worker: no save_kv_layer hook for %s of job %d; copied after the forward "
                    "(not overlapped with it; warned once)", missing, job.job_id,
                )
                self._warned_fallback = True
            for model in (Model.TARGET, Model.DRAFT):
                for layer in range(self.layout.num_layers(model)):
                    self._submit_save(job, model, layer)
        if meta is not None:
            self._sealed.update(job.job_id for job in meta.saves)
            self._absorb(meta)

    def _absorb(self, meta: HiCacheMetadata) -> None:
        """Take the step's delayed requests, once per step (several calls see its metadata)."""
        if meta is not self._absorbed:
            self._absorbed = meta
            self._delayed.update(meta.delayed)

    def _collect_saves(self) -> None:
        """Record the verdict of every sealed save whose copies settled (non-blocking)."""
        for job_id in list(self._sealed):
            job, op = self._saves[job_id]
            if self._record(job, op, block=False):
                del self._saves[job_id]
                self._sealed.discard(job_id)

    def _finish_loads(self) -> None:
        for job, op in self._loads:
            self._record(job, op, block=True)
            if self._results[job.job_id][1] is not None:
                self._load_errors.update(int(b) for b in job.device_pages)
        self._loads.clear()

    def _record(self, job: CopyJob, op: LoadOp | BackupOp, *, block: bool) -> bool:
        """Record the op's verdict for the scheduler once its copies settled; `block`
        waits (host) for them first. Returns whether a verdict was recorded."""
        if block:
            for t in op.inflight:
                try:
                    t.wait()
                except Exception as exc:  # the verdict below carries it
                    op.error = op.error or exc
        vote = op.local_vote()
        if not vote.settled and not block:
            return False
        error = None if vote.ok and vote.settled else str(op.error or "not every layer of every part landed")
        if error is not None:
            logger.warning("hicache-cp worker: %s job %d of %s failed: %s", op.kind, job.job_id, job.req_id, error)
        self._results[job.job_id] = (1, error)
        return True

    # ---- reports ------------------------------------------------------------------------

    def block_ids_with_load_errors(self) -> set[int]:
        """Wait for this step's loads and return the blocks of the failed ones (vLLM
        recomputes them). Called every step: after `wait_for_save`, or before it in
        vLLM's defer-finalize order (a speculative draft forward still to come)."""
        self._finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def finished_sending(self) -> set[str]:
        """Delayed finished requests none of whose saves is in flight on this worker."""
        if not self._delayed:
            return set()
        self._collect_saves()
        busy = {job.req_id for job, _ in self._saves.values()}
        done = self._delayed - busy
        self._delayed -= done
        return done

    def worker_meta(self) -> HiCacheWorkerMetadata | None:
        self._collect_saves()
        if not self._results:
            return None
        results, self._results = self._results, {}
        return HiCacheWorkerMetadata(results)

    def close(self) -> None:
        for job, op in self._saves.values():  # let every copy return before its memory goes
            self._record(job, op, block=True)
        self._saves.clear()
        self._sealed.clear()
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

