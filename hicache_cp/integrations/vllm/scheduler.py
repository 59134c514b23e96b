"""The scheduler-process side of the connector: the cache's decisions.

Runs in: vLLM's scheduler (engine-core) process, one instance per engine.
It holds the `HiCache` that decides everything (radix tree of host copies,
L2 allocator and eviction, backup and load state machines), built on an
index-only host pool (no memory here: the bytes are in the workers) and a
`RemoteCopyEngine` whose copies run in the workers. vLLM's own prefix cache
is the L1 index; the tree holds host copies only (`hicache_cp.cache.engine_l1`).

One request, as vLLM's `Scheduler` drives it:

    get_num_new_matched_tokens(req, local)   match_prefix(all tokens): the committed L2 path,
                                             locked; offer the whole pages beyond vLLM's own
                                             hit, leaving at least one token to compute
    update_state_after_alloc(req, blocks, n) load_into(match, the blocks vLLM gave those pages)
    build_connector_meta(step)               reserve_host_copy for every scheduled request's
                                             pages that this step completes (write-through,
                                             PENDING until every worker landed every layer);
                                             matches that did not become loads are released
    update_connector_output(out)             the workers' per-job verdicts (a save's may come
                                             steps later) resolve the op's tickets; poll()
                                             commits / aborts; a decided load releases its
                                             match; ensure_free()
    request_finished(req, blocks)            delays freeing the blocks while a save of the
                                             request is undecided: the next step's metadata
                                             names it (`delayed`) and every worker reports it
                                             through get_finished once its saves landed there

A failed load is reported by the workers to vLLM as invalid blocks (vLLM
truncates the request's computed tokens and recomputes); here the load op
aborts, the host copy stays valid, and every backup reserved while it was
undecided (`after`) aborts with it. Nothing partial is ever offered as a hit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from hicache_cp import BackupOp, DevicePool, HiCache, HostPool, LoadOp, LoadState, MatchResult, Model
from hicache_cp import EventLog, metric_family_values
from hicache_cp.integrations.vllm.metadata import CopyJob, HiCacheMetadata, HiCacheWorkerMetadata
from hicache_cp.integrations.vllm.plan import KVPlan
from hicache_cp.integrations.vllm.remote import RemoteCopyEngine, resolve_op
from hicache_cp.integrations.vllm.settings import ConnectorSettings
from hicache_cp.integrations.vllm.stats import HiCacheStats, Reporter
from hicache_cp import failure_from_report
from hicache_cp import NodeTier
from hicache_cp import LocalAgreement
from hicache_cp import CopyFailed

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Req:
    """What the connector keeps for one vLLM request."""

    request: Request
    eligible: bool  # tokens alone identify its KV (no LoRA, multimodal input, cache salt, embeds)
    match: MatchResult | None = None  # locked L2 path: until this step's meta, or until `load` is decided
    local_pages: int = 0  # vLLM's own prefix hit, in pages, at the last lookup
    load: LoadOp | None = None
    covered: int = 0  # pages [0, covered) have a host copy or a reservation, as far as we know
    finished: bool = False
    lookup: tuple[int, int] | None = None  # (prompt tokens, vLLM's own prefix pages) at the last lookup
    counted: bool = False  # in the hit metrics (once, when vLLM allocated its blocks)
    token_ids: np.ndarray | None = None  # int64 copy of a prefix of `request.all_token_ids` (`tokens`)

    def tokens(self, n: int) -> np.ndarray:
        """The request's first `n` token ids as int64 (a view of one cached copy). A
        request's tokens only grow, so the copy is remade only when a longer prefix
        is asked for (a lookup again each step of a waiting request, every page a
        decode completes): O(n) then, O(1) otherwise."""
        ids = self.token_ids
        if ids is None or len(ids) < n:
            ids = self.token_ids = np.asarray(self.request.all_token_ids, dtype=np.int64)
            if len(ids) < n:
                raise ValueError(f"{self.request.request_id}: {n} tokens asked, the request has {len(ids)}")
        return ids[:n]


@dataclass
class SchedulerStats:
    """Counters of the scheduler side (tests and logs)."""

    lookups: int = 0
    offered_tokens: int = 0  # tokens offered to vLLM beyond its own prefix cache
    loads_started: int = 0
    loads_done: int = 0
    loads_failed: int = 0
    saves_started: int = 0
    saved_pages: int = 0


class SchedulerSide:
    """The scheduler role of `HiCacheConnector`; see the module docstring."""

    def __init__(self, plan: KVPlan, settings: ConnectorSettings, world_size: int,
                 events: EventLog | None = None) -> None:  # fmt: skip
        self.settings = settings
        self.events = events  # L2/L3 KV events for vLLM's publisher (`take_events`), when it publishes
        config = settings.cache_config(plan.layout)
        # The node tier: this process keeps the journal (and adopts it); the workers hold the copy.
        self.node = NodeTier(config, config.layout(), LocalAgreement(), settings.host_budget_bytes,
                             session=settings.node_session, writer=True) if config.node_segment else None  # fmt: skip
        self.cache = self._make_cache(plan)
        self.plan = plan
        self._layout = self.cache.layout.describe()
        layout = self.cache.layout
        self._model_layers = [(m, range(n)) for m in (Model.TARGET, Model.DRAFT) if (n := layout.num_layers(m))]
        self.world_size = world_size
        self.stats = SchedulerStats()
        self._reporter = Reporter()
        self._reqs: dict[str, _Req] = {}
        # Subsets of `_reqs` a step's bookkeeping walks, so its cost follows the requests
        # with a lookup or a load, not every running one: a locked match, a load started.
        self._matched: dict[str, _Req] = {}
        self._loading: dict[str, tuple[_Req, LoadOp]] = {}
        self._jobs: dict[int, tuple[BackupOp | LoadOp, str]] = {}  # job id -> op, request id
        self._reported: dict[int, tuple[int, str | None]] = {}  # partial reports (fewer workers)
        self._loads: list[CopyJob] = []  # started this step, sent with its metadata
        self._delayed: list[str] = []  # finished with saves undecided, sent with the next metadata

    # ---- vLLM's scheduler calls ---------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Whole pages of the committed L2 path beyond vLLM's own `num_computed_tokens`
        (block-aligned), capped so at least one token is computed; loaded
        synchronously (per layer, inside the step). O(pages matched)."""
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Req(request, _eligible(request))
        if not st.eligible or (st.load is not None and st.load.active):
            return 0, False  # (a preempted request whose previous load is not decided yet: no hit)
        self._release(st)  # a repeated lookup: vLLM could not place the request last time
        bs = self.plan.block_size
        self.stats.lookups += 1
        tokens = st.tokens(request.num_tokens)
        local = num_computed_tokens // bs
        # vLLM looks a waiting request up again each step; it loads nothing below its own prefix
        m = self.cache.match_prefix(tokens, count=False, checked_from=local)
        st.lookup = (len(tokens), local)
        end = min(m.device_len + m.host_len, (request.num_tokens - 1) // bs)
        if end <= local:
            self.cache.release(m.last_node)
            return 0, False
        st.match, st.local_pages = m, local
        self._matched[request.request_id] = st
        self.stats.offered_tokens += (end - local) * bs
        return (end - local) * bs, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Start the load of the offered pages into the blocks vLLM allocated for them."""
        st = self._reqs.get(request.request_id)
        if st is not None and st.lookup is not None and not st.counted:
            st.counted = True  # vLLM's prefix hit as L1, the pages loaded from here as L2
            bs = self.plan.block_size
            self.cache.metrics.record_match(*st.lookup, num_external_tokens // bs, bs)
        if st is None or st.match is None or (st.load is not None and st.load.active):
            return
        if num_external_tokens == 0:
            self._release(st)
            return
        bs = self.plan.block_size
        if num_external_tokens % bs:
            raise ValueError(f"{request.request_id}: {num_external_tokens} external tokens is not whole pages of {bs}")
        n = num_external_tokens // bs
        block_ids = blocks.get_block_ids()[0]
        dev = np.asarray(block_ids[st.local_pages : st.local_pages + n], dtype=np.int64)
        if len(dev) != n:
            raise ValueError(f"{request.request_id}: {len(block_ids)} blocks, the load needs [{st.local_pages}, +{n})")
        op = self.cache.load_into(st.match, dev, st.local_pages)
        st.load = op
        self._loading[request.request_id] = (st, op)
        self._jobs[op.id] = (op, request.request_id)
        self._loads.append(CopyJob(op.id, request.request_id, dev, op.host_pages, st.local_pages))
        self.stats.loads_started += 1

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HiCacheMetadata:
        """This step's loads, and write-through backups of every page this step completes."""
        saves: list[CopyJob] = []
        blocks_of = scheduler_output.kv_connector_block_state
        bs = self.plan.block_size
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or not st.eligible or blocks_of is None:
                continue
            req = st.request
            pages = min(req.num_computed_tokens + n, req.num_tokens) // bs  # KV final after this step
            if pages <= st.covered:
                continue
            block_ids = np.asarray(blocks_of.resolve_block_ids(req_id)[0][:pages], dtype=np.int64)
            after = [st.load] if st.load is not None and st.load.active else []
            for op in self.cache.reserve_host_copy(st.tokens(pages * bs), block_ids, after):
                for model, layers in self._model_layers:  # the workers copy each layer as its hook fires
                    self.cache.on_layers_end(model, layers, [op])  # here: one call for all of them
                self._jobs[op.id] = (op, req_id)
                saves.append(CopyJob(op.id, req_id, op.device_pages, op.host_pages, op.first_position))
                self.stats.saves_started += 1
                self.stats.saved_pages += op.num_pages
            st.covered = pages
        for st in [st for st in self._matched.values() if st.load is None]:
            self._release(st)  # looked up but not placed this step
        meta = HiCacheMetadata(
            self.cache.host_pool.physical_pages, self._layout, self._loads, saves,
            preempted=sorted(scheduler_output.preempted_req_ids or ()), delayed=self._delayed,
        )
        self._loads, self._delayed = [], []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Apply the workers' verdicts: commits, aborts, released matches."""
        meta = output.kv_connector_worker_meta
        if isinstance(meta, HiCacheWorkerMetadata):
            for job, (count, error) in meta.results.items():
                had, had_error = self._reported.pop(job, (0, None))
                count, error = had + count, had_error or error
                if count < self.world_size:
                    self._reported[job] = (count, error)
                    continue
                op, req_id = self._jobs.pop(job)
                resolve_op(op.inflight, None if error is None else failure_from_report(f"{req_id}: {error}"))
        self.cache.poll()
        for req_id, (st, load) in [(r, v) for r, v in self._loading.items() if not v[1].active]:
            if load.state is LoadState.ABORTED:
                self.stats.loads_failed += 1
                st.covered = min(st.covered, load.first_position)  # vLLM recomputes from there
            else:
                self.stats.loads_done += 1
            st.load = None
            del self._loading[req_id]
            self._release(st)
            if st.finished:  # (`request_finished` forgot it already if it had no load)
                del self._reqs[req_id]
        self.cache.ensure_free()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. Returns True (vLLM keeps its blocks) while one of its saves
        is undecided: the workers still read those blocks. O(jobs in flight)."""
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is not None:
            st.finished = True
            if st.load is None:
                self._release(st)
                del self._reqs[rid]
        delay = any(r == rid and isinstance(op, BackupOp) for op, r in self._jobs.values())
        if delay:
            self._delayed.append(rid)
        return delay, None

    def metrics_report(self) -> HiCacheStats | None:
        """The cache's metric families changed since the last report (`stats.Reporter`);
        not L1's pool, which is vLLM's."""
        values = metric_family_values(self.cache.stats(), self.cache.events)
        values["pool_pages"] = {k: v for k, v in values["pool_pages"].items() if k[0] != "l1"}
        return self._reporter.report(values)

    def close(self) -> None:
        self.cache.close()
        if self.node is not None:
            self.node.close()

    def reset(self) -> bool:
        """vLLM's `reset_prefix_cache(reset_connector=True)`: a new, empty cache (its
        event log announces the old one's blocks gone). False while copies or
        requests are in flight (vLLM then reports the reset failed)."""
        if self._jobs or self._reqs:
            return False
        self.cache.close(discard=True)  # the node tier's journal forgets the old copies: none is adopted
        self.cache = self._make_cache(self.plan)
        return True

    # ---- helpers ------------------------------------------------------------------------

    def _make_cache(self, plan: KVPlan) -> HiCache:
        config = self.settings.cache_config(plan.layout)
        layout = config.layout()
        device_pool = DevicePool(layout, 2)  # unused: vLLM owns the device pages
        host_pool = HostPool(layout, self.settings.host_budget_bytes, memory=False)
        return HiCache(config, device_pool=device_pool, host_pool=host_pool,
                       engine=RemoteCopyEngine(device_pool, host_pool), events=self.events, node=self.node)  # fmt: skip

    def _release(self, st: _Req) -> None:
        if st.match is not None:
            self.cache.release(st.match.last_node)
            st.match = None
            del self._matched[st.request.request_id]

    def in_flight_jobs(self) -> int:
        return len(self._jobs)


def _eligible(request: Request) -> bool:
    """Whether the token ids alone identify the request's KV (the tree's keys are tokens):
    vLLM adds no extra key (LoRA adapter, multimodal input, cache salt, prompt embeddings,
    whatever a later vLLM adds) to any of its block hashes. Once per request."""
    if getattr(request, "prompt_embeds", None) is not None:
        return False  # (its extra keys would hash the embeddings)
    keys, _ = generate_block_hash_extra_keys(request, 0, request.num_tokens, 0)
    return keys is None
