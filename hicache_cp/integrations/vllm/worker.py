"""The worker-process side of the connector: the bytes.

Runs in: every vLLM worker (one per GPU), once per engine step, inside the
forward. vLLM's paged KV tensors become the L1 `DevicePool` (page-major
uint8 views, no copy); the L2 `HostPool` (pinned where CUDA is) and the copy
engine live here. The worker makes no decision: it runs the scheduler's jobs
(`HiCacheMetadata`) with the cache's own op types, per layer:

    handle_preemptions     saves of requests vLLM preempted this step are waited for (their
                           blocks are free and this step may write them); rare, host-blocking
    start_load_kv          every load job: a `LoadOp`, planned once and every layer of every
                           part submitted in forward order in one engine call (H2D stream).
                           When no layer hook will run (a full CUDA-graph replay), the compute
                           stream waits for every layer here instead (no host block)
    wait_for_layer_load(l) the forward waits for layer l (`LoadOp.wait_layer`; on CUDA the
                           compute stream waits on the layer's event, the host does not block)
    save_kv_layer(l)       the step's save jobs, copied as one `BackupOp` (`_StepSaves`):
                           layer l is due once attention wrote it; once a group of layers
                           is due (`backup_layer_group`) their D2H goes out in one engine call
    wait_for_save          the last group, and layers whose hook never fired, are submitted
                           now, after the forward
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

Host cost per step. Each op is planned once (`CopyEngine.plan`: page lists
checked, the backend's descriptors made for every layer), so a layer's
submission does no per-page work; on CUDA the default engine hands a layer's
descriptors to its issue thread (`hicache_cp.io.dma`) and the hook pays for
one event record. The save jobs of a step share one op: one submission per
group of layers whatever the number of requests, and one verdict for all of them (a
failed copy fails every save of the step: each is then a future miss, never
a partial hit). A load keeps its own op, so a failed load, and a failed
restore check, name its own blocks and host copy. A step with no job and
nothing in flight makes no engine call.

Restore checks (`Config.verify_restores`, `hicache_cp.io.verify`): the
engine checksums what each save copied and stores it beside the host copy;
every load's landed pages are checked against it before its verdict, at the
step's end. The checks of a load follow its copies, not the forward: vLLM
never writes a loaded block in the step that loads it (a load ends at a
block boundary where the request's computed tokens begin), and the step's
end must not wait for the forward to finish.

Parts read before their layer's hook: the MLA indexer's cache (Part.TARGET_STATE)
of layer l is read by layer l's indexer before layer l's attention, so it is
waited for at layer l-1's hook (layer 0's at `start_load_kv`); draft parts
are waited for at the last target layer's hook.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from hicache_cp import BackupOp, BackupState, DevicePool, HostPool, LoadOp, LoadState, Model, Part
from hicache_cp import (
    CopyEngine,
    CopyFailed,
    CopyPlan,
    Direction,
    LocalAgreement,
    NodeTier,
    Verify,
    backup_layer_group,
    make_engine,
    sample_positions,
)
from hicache_cp.integrations.vllm.metadata import CopyJob, HiCacheMetadata, HiCacheWorkerMetadata
from hicache_cp.integrations.vllm.plan import KVPlan
from hicache_cp.integrations.vllm.settings import ConnectorSettings
from hicache_cp.integrations.vllm.stats import HiCacheStats, Reporter, integrity_values

logger = logging.getLogger(__name__)

_STATE_OF = {Model.TARGET: Part.TARGET_STATE, Model.DRAFT: Part.DRAFT_STATE}


@dataclass(frozen=True, slots=True)
class _Hook:
    """What a vLLM layer's hooks do, looked up once per layer name (so a hook does no
    layout lookup per call)."""

    model: Model
    layer: int
    saves: bool  # its save hook copies the layer (an indexer cache goes with its attention layer's)
    #: The state part's layer read before the next attention layer (the indexer's), waited for
    #: at this hook: (part, layer), or None where the layout has no such layer.
    next_state: tuple[Part, int] | None
    #: The draft layers waited for at this hook (all of them at the last target layer's).
    draft_layers: range


@dataclass(eq=False)
class _StepSaves:
    """The save jobs of one step, copied as one `BackupOp` (one engine call per group of layers).
    `sealed` once every layer was submitted (`wait_for_save` ran); decided once sealed
    and settled, with one verdict for every job."""

    meta: HiCacheMetadata
    jobs: list[CopyJob]
    op: BackupOp
    plan: CopyPlan  # the op's (`CopyEngine.plan`)
    due: dict[Model, list[int]] = field(default_factory=lambda: {Model.TARGET: [], Model.DRAFT: []})  # hooked, not submitted
    sealed: bool = False

    @property
    def req_ids(self) -> set[str]:
        return {job.req_id for job in self.jobs}


class WorkerSide:
    """The worker role of `HiCacheConnector`; see the module docstring."""

    def __init__(self, plan: KVPlan, settings: ConnectorSettings) -> None:
        self.plan = plan
        self.settings = settings
        self.node: NodeTier | None = None
        self.config = settings.cache_config(plan.layout)
        self.layout = self.config.layout()
        self._described = self.layout.describe()  # checked against every step's metadata
        submits = self.config.backup_submits_per_forward
        self._groups = {m: backup_layer_group(self.layout.num_layers(m), submits) for m in Model}
        self._reporter = Reporter()
        self.device_pool: DevicePool | None = None
        self.host_pool: HostPool | None = None
        self.engine: CopyEngine | None = None
        self._hooks: dict[str, _Hook] = {}
        self._loads: list[tuple[CopyJob, LoadOp]] = []
        self._saves: list[_StepSaves] = []  # submitted, verdict not recorded yet; oldest first
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
        self.engine.warm_up()  # on CUDA the checksum kernel compiles here, not in a request's step
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
        for saves in list(self._saves):
            if saves.req_ids & preempted:
                self._record_saves(saves, block=True)
                self._saves.remove(saves)

    def start_load_kv(self, meta: HiCacheMetadata, layer_hooks: bool = True) -> None:
        """Submit every load of the step. `layer_hooks`: the forward will call
        `wait_for_layer_load` per layer; when it will not (a full CUDA-graph replay),
        the compute stream waits for every layer of every load here."""
        engine = self._engine(meta)
        self._absorb(meta)
        for job in meta.loads:
            self._loads.append((job, self._start_load(engine, job)))
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

    def _start_load(self, engine: CopyEngine, job: CopyJob) -> LoadOp:
        """One load job: planned, then every layer of every part in one engine call. A
        submission refused part-way fails the op (its started copies stay in flight
        and are waited for at the step's end)."""
        op = LoadOp(self.layout, job.device_pages, job.host_pages, job.first_position, request=job.req_id)
        op.plan = plan = engine.plan(Direction.H2D, job.device_pages, job.host_pages)
        plan.request = job.req_id
        plan.check = sample_positions(plan.num_pages, job.job_id, self.config.verify_restores)
        plan.checks_follow_compute = False  # vLLM writes no loaded block in the step (module docstring)
        jobs = op.all_layers()
        try:
            op.record_layers(jobs, engine.submit_layers(plan, jobs))
        except CopyFailed as exc:
            op.inflight.extend(exc.submitted)
            op.error = op.error or exc
        op.transition(LoadState.LOADING)
        return op

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loads:
            return
        hook = self._hook(layer_name)
        for _, op in self._loads:
            op.wait_layer(hook.layer, hook.model)
        if hook.next_state is not None:
            part, layer = hook.next_state
            for _, op in self._loads:
                op.wait_part(part, layer)
        for layer in hook.draft_layers:
            for _, op in self._loads:
                op.wait_layer(layer, Model.DRAFT)

    def _wait_part(self, part: Part, layer: int) -> None:
        if not self.layout.has_part_layer(part, layer):
            return
        for _, op in self._loads:
            op.wait_part(part, layer)

    # ---- saves --------------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, meta: HiCacheMetadata) -> None:
        """Layer `layer_name` of the step's saves is written; a group of them goes out in
        one engine call. O(1) per call after the step's first (which plans the step's
        saves: O(pages))."""
        if not meta.saves:
            return
        hook = self._hook(layer_name)
        if not hook.saves:
            return  # copied with its attention layer, whose hook comes after the indexer wrote it
        saves = self._step_saves(meta)
        due = saves.due[hook.model]
        due.append(hook.layer)
        if len(due) >= self._groups[hook.model]:
            self._submit_due(saves, hook.model)

    def _submit_due(self, saves: _StepSaves, model: Model) -> None:
        """The layers of `model` hooked since the last submission, in one engine call."""
        op, due = saves.op, saves.due[model]
        jobs = [(parts, layer) for layer in due if (parts := op.layers_to_submit(model, layer))]
        due.clear()
        if not jobs:
            return
        op.record_layers(jobs, self._engine(None).submit_layers(saves.plan, jobs))
        if op.state is BackupState.RESERVED:
            op.transition(BackupState.WRITING)

    def wait_for_save(self, meta: HiCacheMetadata | None) -> None:
        """Submit the layers no hook reported, after the forward wrote them. Never waits."""
        if meta is not None and meta.saves:
            saves = self._step_saves(meta)
            if not saves.sealed:
                for model in (Model.TARGET, Model.DRAFT):
                    self._submit_due(saves, model)
                self._submit_missing(saves)
                saves.sealed = True
        if meta is not None:
            self._absorb(meta)

    def _step_saves(self, meta: HiCacheMetadata) -> _StepSaves:
        """The step's `_StepSaves`, made (and planned) at its first use. O(pages) then, O(1) after."""
        last = self._saves[-1] if self._saves else None
        if last is not None and last.meta is meta:
            return last
        engine = self._engine(None)
        jobs = meta.saves
        dev = jobs[0].device_pages if len(jobs) == 1 else np.concatenate([job.device_pages for job in jobs])
        host = jobs[0].host_pages if len(jobs) == 1 else np.concatenate([job.host_pages for job in jobs])
        op = BackupOp(self.layout, dev, host, 0, layerwise=True)
        op.plan = plan = engine.plan(Direction.D2H, dev, host)
        saves = _StepSaves(meta, list(jobs), op, plan)
        self._saves.append(saves)
        return saves

    def _submit_missing(self, saves: _StepSaves) -> None:
        """Every layer of the step's saves that no hook submitted, in one engine call."""
        op = saves.op
        if not any(op.submitted.values()):  # no hook fired: a full CUDA-graph replay (or no layer hook at all)
            logger.debug("hicache-cp worker: %d save jobs copied after the forward (no layer hook ran)",
                         len(saves.jobs))
            jobs = op.all_layers()
        else:
            missing = op.missing_layers()
            if not missing:
                return
            if not self._warned_fallback:
                logger.warning(
                    "hicache-cp worker: no save_kv_layer hook for %s of the saves of %s; copied after the "
                    "forward (not overlapped with it; warned once)", missing, sorted(saves.req_ids),
                )
                self._warned_fallback = True
            jobs = [(parts, layer) for model in (Model.TARGET, Model.DRAFT) for layer in range(self.layout.num_layers(model))
                    if (parts := op.layers_to_submit(model, layer))]  # fmt: skip
        op.record_layers(jobs, self._engine(None).submit_layers(saves.plan, jobs))
        if op.state is BackupState.RESERVED:
            op.transition(BackupState.WRITING)

    def _absorb(self, meta: HiCacheMetadata) -> None:
        """Take the step's delayed requests, once per step (several calls see its metadata)."""
        if meta is not self._absorbed:
            self._absorbed = meta
            if meta.delayed:
                self._delayed.update(meta.delayed)

    def _collect_saves(self) -> None:
        """Record the verdict of every sealed save whose copies settled (non-blocking)."""
        if self._saves:
            self._saves = [s for s in self._saves if not (s.sealed and self._record_saves(s, block=False))]

    def _record_saves(self, saves: _StepSaves, *, block: bool) -> bool:
        """`_record` of the step's one op: its verdict goes to each of its jobs."""
        return self._record(saves.op, saves.jobs, block=block)

    def _finish_loads(self) -> None:
        for job, op in self._loads:
            self._record(op, [job], block=True)
            if self._results[job.job_id][1] is not None:
                self._load_errors.update(int(b) for b in job.device_pages)
        self._loads.clear()

    def _record(self, op: LoadOp | BackupOp, jobs: list[CopyJob], *, block: bool) -> bool:
        """Record the op's verdict for the scheduler, for each of `jobs`, once its copies
        settled; `block` waits (host) for them first. Returns whether a verdict was recorded."""
        if block:
            for t in reversed(op.inflight):  # the last first: then the others have landed
                try:
                    t.wait()
                except Exception as exc:  # the verdict below carries it
                    op.error = op.error or exc
        vote = op.local_vote()
        if not vote.settled and not block:
            return False
        error = None if vote.ok and vote.settled else str(op.error or "not every layer of every part landed")
        if error is not None:
            logger.warning("hicache-cp worker: %s of jobs %s (requests %s) failed: %s", op.kind,
                           [job.job_id for job in jobs], sorted({job.req_id for job in jobs}), error)  # fmt: skip
        for job in jobs:
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
        busy = {job.req_id for saves in self._saves for job in saves.jobs}
        done = self._delayed - busy
        self._delayed -= done
        return done

    def worker_meta(self) -> HiCacheWorkerMetadata | None:
        self._collect_saves()
        if not self._results:
            return None
        results, self._results = self._results, {}
        return HiCacheWorkerMetadata(results)

    def metrics_report(self) -> HiCacheStats | None:
        """This worker's restore checks since the last report (`stats.Reporter`)."""
        if self.engine is None:
            return None
        units = sum(p.num_slots for p in self.layout.parts)
        return self._reporter.report(integrity_values(self.engine.integrity.families(units, 0)))

    def close(self) -> None:
        for saves in self._saves:  # let every copy return before its memory goes
            self._record_saves(saves, block=True)
        self._saves.clear()
        if self.engine is not None:
            self.engine.close()
        if self.host_pool is not None:
            self.host_pool.close()
        if self.node is not None:
            self.node.close()

    # ---- helpers ------------------------------------------------------------------------

    def _hook(self, layer_name: str) -> _Hook:
        """What `layer_name`'s hooks do (ValueError for a layer the plan lacks). O(1)."""
        hook = self._hooks.get(layer_name)
        if hook is None:
            where = self.plan.slot(layer_name)
            last = where.model is Model.TARGET and where.layer == self.layout.num_target_layers - 1
            state, after = _STATE_OF[where.model], where.layer + 1
            next_state = (state, after) if self.layout.has_part_layer(state, after) else None
            hook = _Hook(where.model, where.layer, where.part not in (Part.TARGET_STATE, Part.DRAFT_STATE),
                         next_state, range(self.layout.num_draft_layers if last else 0))  # fmt: skip
            self._hooks[layer_name] = hook
        return hook

    def _engine(self, meta: HiCacheMetadata | None) -> CopyEngine:
        if self.engine is None or self.host_pool is None:
            raise RuntimeError("hicache-cp worker: copies requested before register_kv_caches")
        if meta is not None and meta.layout and meta.layout != self._described:
            raise ValueError(
                f"the scheduler's KV layout ({meta.layout}) differs from this worker's ({self._described}): "
                f"the two processes read vLLM's KV cache config differently"
            )
        if meta is not None and meta.host_pages != self.host_pool.physical_pages:
            raise ValueError(
                f"the scheduler allocates from {meta.host_pages} L2 pages but this worker holds "
                f"{self.host_pool.physical_pages}: host budget or KV layout differ between the processes"
            )
        return self.engine
