"""`HiCacheCpRadixCache`: SGLang's radix cache with hicache-cp as its host tier (L2).

Runs in: each SGLang scheduler process (one per TP rank), on the scheduler
thread; the layer hooks (`layer_hooks`) run inside the same process's forward.

The device tier stays SGLang's: its `RadixCache` (this class's base) indexes
the token-to-KV pool, and its allocator owns every device slot. hicache-cp
holds the host copies only, in its own tree (engine-owned L1,
`hicache_cp.cache.engine_l1`), over pinned host pages, with SGLang's pools
viewed as its L1 (`pools`). One request, in the order SGLang 0.5.23's
scheduler calls (the model is FlexKV's tree cache, `storage/flexkv/`):

    match_prefix(req)            SGLang's device match, then hicache-cp's committed L2 path
                                 (locked); whole pages of it past the device prefix become
                                 `host_hit_length`; every round replaces the last offer
    init_load_back(req)          admission: device slots for those pages from SGLang's
                                 allocator; the load is staged for the next forward; the
                                 slots belong to the request (`load_back_is_cache_owned` is
                                 False) until its checkpoint inserts them like computed KV
    prefix_device_indices(req)   the device path plus the loaded slots
    maybe_hand_to_session(req)   after allocation, before the forward: the whole pages this
                                 forward completes are staged for a write-through reservation
    -- forward start --          (the TP worker's set_hicache_consumer) the step's page ids
                                 are read on the host once (`page_ids`), then each staged
                                 load submits H2D of every layer of every part (`load_into`)
                                 and each staged reservation reserves L2 for the pages L2
                                 lacks (PENDING, invisible), on the forward's stream, so
                                 both follow the forward before (`fence`)
    -- forward --                layer hooks: waits per layer, D2H per layer (`layer_hooks`)
    checkpoint(req, up_to)       the forward's remaining layers submitted (behind the
                                 forward); the request's load decided (poll): landed ->
                                 SGLang's insert; failed, or refused at the forward's start
                                 -> nothing of the request enters either tree and it
                                 finishes with an error (its forward read the failed
                                 pages); the inserted path stays evictable, its last node
                                 noted as read by the request's undecided backups
    flush_pending_backups()      after each batch: poll (commit: visible to match_prefix;
                                 abort: released), L2 free room
    evict(params)                SGLang's eviction (it evicts only when it needs room); the
                                 copies still reading the slots it freed are waited for
                                 before it returns, so nothing reuses them under a copy
    free_kv_row / on_release     slots go back to SGLang only once no copy into or out of
                                 them is in flight
    release_aborted_request      an aborted attempt drops its offer and its locks

All-or-nothing, visibility on commit, free room and eviction are `HiCache`'s.

Device room never waits for a decision. SGLang 0.5.23's scheduler calls
nothing of a registered tree cache in a round that admits nothing and runs
no batch (its `on_idle` returns early while requests wait; it calls
`check_hicache_events` only for its own HiCache, and `flush_pending_backups`
only after a batch). A device path held until its backups are decided
would then stall for good a queue whose admission needs those pages. So a
checkpoint locks nothing: a backup only needs the device slots it reads
until its copies (and their checksums) have run, and an eviction that frees
such slots waits for exactly those copies, bounded by their own transfer
(their forward has finished: the request's results were processed). The
decision stays at the flush and concerns host pages only.

A load with no device room is no hit: `init_load_back` returns 0 and SGLang
recomputes. A load the copy engine refuses at the forward's start fails its
request like a load that fails in flight. A committed host copy lacking a
part raises `ConsistencyError` from `match_prefix` (never a target-only hit).

No device tensor is read per request: page ids reach the host once a forward (`page_ids`).

KV events go to this radix cache's own recorder in SGLang's format (`events`);
each request enters the metrics once (`metrics`; docs/events.md).

Ranks: each TP rank runs this scheduler on the same requests in the same
order and keeps the L2 of what its pools hold; every decision (commit,
abort, load outcome) is agreed with one MIN all-reduce per poll over the
ranks that run one DP rank's batch (SGLang's `tp_cache_group`, handed to the
factory; `DistributedAgreement`), so all of them apply the same decision at
the same step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.mem_cache.base_prefix_cache import (
    CacheRequestHandle,
    EvictParams,
    EvictResult,
    InitLoadBackParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode

from hicache_cp import Agreement, BackupOp, HiCache, LoadOp, LoadState, Model
from hicache_cp import MatchResult as HostMatch
from hicache_cp.integrations.sglang.events import recorder_log
from hicache_cp.integrations.sglang.fence import ForwardFence
from hicache_cp.integrations.sglang.layer_hooks import ForwardCopies, LayerHooks
from hicache_cp.integrations.sglang.page_ids import HostIndices, warm_up_page_ids
from hicache_cp.integrations.sglang.pools import SGLangKV
from hicache_cp.integrations.sglang.metrics import RequestCounts, serve_metrics
from hicache_cp.integrations.sglang.settings import metrics_port, resolve
from hicache_cp import CopyFailed
from hicache_cp import DevicePool

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Flow:
    """What the plug-in keeps for one request attempt (SGLang's `CacheRequestHandle`)."""

    match: HostMatch | None = None  # the L2 path offered, locked until the load is decided or dropped
    device_len: int = 0  # SGLang's device prefix (tokens) when it was offered
    host_tokens: int = 0  # tokens offered from L2 past the device prefix
    load: LoadOp | None = None
    load_staged: bool = False  # admitted; its copies are submitted at the next forward's start
    load_error: str | None = None  # the copy engine refused the submission at the forward's start
    loaded_slots: torch.Tensor | None = None  # request-owned slots the load writes, until checkpoint
    kv: Any = None  # the request's ReqKvInfo (its row), to find the flow when SGLang frees slots
    backups: list[BackupOp] = field(default_factory=list)
    freed: list[tuple[int, int]] = field(default_factory=list)  # row positions SGLang's insert freed

    @property
    def admitted(self) -> bool:
        """init_load_back took the offer: the host tokens are the request's prefix."""
        return self.load_staged or self.load is not None or self.load_error is not None


@dataclass(eq=False)
class _Staged:
    """A load or a reservation deferred to the next forward's start, with its page ids'
    handle in `HostIndices` (`tokens`: a reservation's whole pages of tokens)."""

    flow: _Flow
    handle: int
    tokens: np.ndarray | None = None


@dataclass
class PluginStats:
    """Counters of the plug-in's decisions (tests, benchmarks, logs)."""

    offered_tokens: int = 0  # host_hit_length handed to SGLang
    loaded_tokens: int = 0  # tokens whose load landed
    failed_loads: int = 0  # loads that aborted or were refused after admission (the request failed)
    refused_loads: int = 0  # offers without device room (SGLang recomputed)
    reserved_pages: int = 0  # write-through reservations
    duplicate_waits: int = 0  # backups whose source slots SGLang freed as duplicates (waited for)
    eviction_waits: int = 0  # evictions that waited for a backup still reading the slots they freed


class HiCacheCpRadixCache(RadixCache):
    """SGLang's `RadixCache` with hicache-cp as L2; see the module docstring."""

    def __init__(
        self,
        params: CacheInitParams,
        *,
        draft_pools: tuple[Any, ...] = (),
        agreement: Agreement | None = None,
        env: dict[str, str] | None = None,
        forward_stream: Any = None,
    ) -> None:
        """`forward_stream`: the model runner's forward stream (the fence of copies the
        scheduler thread submits); None where there is none (CPU)."""
        self._flows: dict[CacheRequestHandle, _Flow] = {}
        self.counts = RequestCounts()
        # SGLang's device nodes whose slots undecided backups may still read (keyed by the
        # inserted path's last node: its ancestors evict only after it), and the backups of
        # the nodes the eviction in progress deleted.
        self._read_by: dict[TreeNode, list[BackupOp]] = {}
        self._evicted_reads: list[BackupOp] = []
        super().__init__(params)
        target = params.token_to_kv_pool_allocator.get_kvcache()
        self.kv = SGLangKV.from_pools(target, draft_pools)
        self.resolved = resolve(self.kv, env)
        port = metrics_port(env)
        self._agreement = agreement
        self._events = recorder_log(self.kv_events)  # L2/L3 events into SGLang's recorder, when it has one on
        self.cache = self._make_cache()
        self.exporter = None if port is None else serve_metrics(self.cache, port)
        self.fence = ForwardFence(forward_stream)
        self.indices = HostIndices()
        if self.cache.device_pool.is_cuda:
            warm_up_page_ids(self.cache.device_pool.device)
        self._staged: list[_Staged] = []
        self.copies = ForwardCopies(
            self.cache, self.kv.read_ahead, prepare=self._start_staged, cuda=self.cache.device_pool.is_cuda
        )
        self.stats = PluginStats()
        self.hooks = {Model.TARGET: LayerHooks(self.copies, Model.TARGET)}
        target.register_layer_transfer_counter(self.hooks[Model.TARGET])
        first = 0
        for pool in draft_pools:  # one counter per draft pool: its layers numbered across them
            hooks = LayerHooks(self.copies, Model.DRAFT, first, pool.layer_num)
            pool.register_layer_transfer_counter(hooks)
            self.hooks.setdefault(Model.DRAFT, hooks)
            first += pool.layer_num
        logger.info(
            "hicache-cp: L2 of %s (%s) under SGLang: %d device pages of %d tokens, L2 %d pages (%.1f MiB, %s), io %s",
            self.cache.layout.describe(), self.kv.describe(), self.kv.num_pages, self.page_size,
            self.cache.host_pool.physical_pages,
            self.cache.host_pool.split.used_bytes / 2**20, "pinned" if self.cache.host_pool.pinned else "plain",
            self.cache.engine.name,
        )

    def _make_cache(self) -> HiCache:
        config = self.resolved.config
        device_pool = DevicePool(config.layout(), self.kv.num_pages, buffers=self.kv.buffers())
        return HiCache(config, device_pool=device_pool, agreement=self._agreement, events=self._events)

    # ---- match and load ------------------------------------------------------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:  # type: ignore[override]
        base = super().match_prefix(params)
        req = params.req
        if req is None or self.disable:
            return base
        handle = req.cache_request_handle
        flow = self._flows.get(handle)
        if flow is not None and flow.admitted:
            return base  # admitted already: the load is the request's prefix
        self._drop_offer(handle)
        if not _eligible(req):
            return base
        whole = len(params.key) // self.page_size * self.page_size  # SGLang's page_aligned, without its copy
        tokens = np.frombuffer(params.key.raw_token_ids(), dtype=np.int64, count=whole)
        device_pages = base.device_prefix_len // self.page_size
        # SGLang matches a request again each round; it loads nothing below its device prefix
        m = self.cache.match_prefix(tokens, count=False, checked_from=device_pages)
        self.counts.matched(handle, len(tokens), device_pages)
        if m.host_len <= device_pages:
            self.cache.release(m.last_node)
            return base
        flow = self._flows.setdefault(handle, _Flow())
        flow.match, flow.device_len = m, base.device_prefix_len
        flow.host_tokens = (m.host_len - device_pages) * self.page_size
        self.stats.offered_tokens += flow.host_tokens
        return base._replace(
            host_hit_length=flow.host_tokens, full_kv_hit_length=base.device_prefix_len + flow.host_tokens
        )

    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, Any]:  # type: ignore[override]
        req, node = params.req, params.best_match_node
        flow = self._flows.get(req.cache_request_handle) if req is not None else None
        if flow is None or flow.match is None or flow.admitted or params.host_hit_length <= 0:
            return 0, node
        if params.host_hit_length != flow.host_tokens:
            raise ValueError(
                f"hicache-cp: request {req.rid} asks to load {params.host_hit_length} tokens, "
                f"match_prefix offered {flow.host_tokens}"
            )
        slots = self._alloc_slots(flow.host_tokens)
        if slots is None:
            self._refuse(req, flow, "no device slots")
            return 0, node
        flow.load_staged, flow.loaded_slots, flow.kv = True, slots, req.kv
        self._staged.append(_Staged(flow, self.indices.add(slots, self.page_size)))
        self.counts.admitted(req.cache_request_handle, flow.host_tokens // self.page_size)
        return flow.host_tokens, node

    def load_back_is_cache_owned(self) -> bool:
        return False  # the loaded slots are the request's until its checkpoint inserts them

    def prefix_device_indices(self, req: Req) -> torch.Tensor:
        path = self.path_device_indices(req.last_node)
        flow = self._flows.get(req.cache_request_handle)
        if flow is not None and flow.loaded_slots is not None and len(path) < req.prefix_len:
            path = torch.cat([path[: flow.device_len], flow.loaded_slots.to(path.device, torch.int64)])
        assert len(path) >= req.prefix_len, (req.rid, len(path), req.prefix_len)
        return path[: req.prefix_len]

    # ---- backups -------------------------------------------------------------------------

    def maybe_hand_to_session(self, req: Req) -> None:
        """After SGLang allocated the request's slots, before the forward: reserve L2 for
        the whole pages this forward completes (write-through, PENDING until committed)."""
        if self.disable or not _eligible(req):
            return
        self.counts.first_forward(req.cache_request_handle, self.cache)
        whole = (req.extend_end // self.page_size) * self.page_size
        if whole <= req.prefix_len - req.prefix_len % self.page_size:
            return
        flow = self._flows.setdefault(req.cache_request_handle, _Flow())
        flow.kv = req.kv
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :whole]  # contiguous: one plain D2H copy
        tokens = np.frombuffer(req.full_untruncated_fill_ids[:whole], dtype=np.int64)  # the slice is a copy
        self._staged.append(_Staged(flow, self.indices.add(row, self.page_size), tokens))

    def _start_staged(self) -> None:
        """At the forward's start (`ForwardCopies.begin`, on the forward's stream): the
        step's page ids read once, then the staged loads submitted and the staged
        reservations made, in the order SGLang staged them."""
        staged, self._staged = self._staged, []
        if not staged:
            return
        slots = self.indices.resolve()
        for item in staged:
            pages = slots[item.handle] // self.page_size
            if item.tokens is None:
                self._start_load(item.flow, pages)
            else:
                self._reserve(item.flow, item.tokens, pages)

    def _start_load(self, flow: _Flow, pages: np.ndarray) -> None:
        """Submit an admitted load (every layer of every part). A refusal fails the request
        at its checkpoint: its forward is about to read those pages."""
        assert flow.match is not None and flow.load_staged
        flow.load_staged = False
        try:
            flow.load = self.cache.load_into(flow.match, pages, flow.device_len // self.page_size)
        except CopyFailed as exc:
            flow.load_error = f"the copy engine refused the load at the forward's start: {exc}"
            logger.warning("hicache-cp: %s", flow.load_error)
            return
        self.copies.stage_load(flow.load)

    def _reserve(self, flow: _Flow, tokens: np.ndarray, device_pages: np.ndarray) -> None:
        """Write-through reservations for the whole pages L2 lacks (none for a request
        whose load was refused: its forward computes from pages that never landed)."""
        if flow.load_error is not None:
            return
        after = [flow.load] if flow.load is not None and flow.load.state is not LoadState.DONE else []
        ops = self.cache.reserve_host_copy(tokens, device_pages, after=after)
        if ops:
            flow.backups.extend(ops)
            self.stats.reserved_pages += sum(len(op.device_pages) for op in ops)
            self.copies.stage_backups(ops)

    def checkpoint(self, req: Req, *, up_to: int, **kwargs: Any) -> None:  # type: ignore[override]
        self._finish_forward()
        flow = self._flows.get(req.cache_request_handle)
        if flow is not None and flow.load_staged:
            raise AssertionError(
                f"hicache-cp: request {req.rid} reached its checkpoint with its load never submitted: its forward "
                "did not start through the TP worker's set_hicache_consumer"
            )
        if flow is not None and flow.match is not None and flow.admitted and not self._load_ok(req, flow):
            return
        super().checkpoint(req, up_to=up_to)
        if flow is None:
            return
        self._wait_for_freed_sources(req, flow)
        pending = [op for op in flow.backups if op.active]
        if pending and req.last_node is not self.root_node:
            self._note_readers(req.last_node, pending)
        flow.backups = pending

    def flush_pending_backups(self) -> None:
        """After every batch: commit or abort what landed (decided copies read no slot), free room."""
        self._finish_forward()
        self.cache.poll()
        for handle, flow in list(self._flows.items()):
            if flow.backups:
                flow.backups = [op for op in flow.backups if op.active]
            if flow.kv is None and flow.match is None and not flow.backups and not flow.load_staged:
                if flow.load is None or not flow.load.active:
                    del self._flows[handle]  # idle: released, nothing offered, nothing undecided
        if self._read_by:
            for node, ops in list(self._read_by.items()):
                ops[:] = [op for op in ops if op.active]
                if not ops:
                    del self._read_by[node]
        self.cache.ensure_free()

    # ---- device eviction -----------------------------------------------------------------

    def evict(self, params: EvictParams) -> EvictResult:
        """SGLang's eviction; before it returns (so before anything can allocate a freed
        slot again) the copies of undecided backups that read the freed slots are waited
        for. A host wait only where such a backup is still copying: bounded by that copy,
        whose forward has finished (see the module docstring). O(evicted nodes)."""
        try:
            return super().evict(params)
        finally:
            ops, self._evicted_reads = self._evicted_reads, []
            for op in ops:
                op.reap()  # non-blocking: copies that returned leave flight
            busy = [op for op in ops if op.inflight]
            if busy:
                self.stats.eviction_waits += 1
                logger.debug("hicache-cp: eviction waits for %d backups reading its slots", len(busy))
                _wait_copies(busy)

    def _delete_leaf(self, node: TreeNode) -> None:
        """SGLang's eviction deletes `node` (its slots were just freed): its readers are
        waited for when the eviction returns (`evict`)."""
        ops = self._read_by.pop(node, None)
        if ops:
            self._evicted_reads.extend(ops)
        super()._delete_leaf(node)

    def _note_readers(self, node: TreeNode, ops: list[BackupOp]) -> None:
        """`ops` read slots of the path ending at `node` (SGLang splits keep `node` as the
        deepest part, and an ancestor is a leaf only once `node` was evicted)."""
        known = self._read_by.setdefault(node, [])
        known.extend(op for op in ops if op not in known)

    # ---- freeing -------------------------------------------------------------------------

    def free_kv_row(self, kv: Any, ranges: list[tuple[int, int]]) -> None:
        """SGLang gives row positions `ranges` back to its allocator: a copy still writing or
        reading those slots is waited for first (only on abort paths do any remain)."""
        for flow in self._flows.values():
            if flow.kv is kv:
                self._unstage(flow)
                _wait_copies([op for op in (flow.load, *flow.backups) if op is not None and self._touches(op, ranges)])
        super().free_kv_row(kv, ranges)

    def _touches(self, op: LoadOp | BackupOp, ranges: list[tuple[int, int]]) -> bool:
        lo = op.first_position * self.page_size
        hi = lo + len(op.device_pages) * self.page_size
        return any(start < hi and lo < end for start, end in ranges)

    def on_release(self, req: Req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self.counts.forget(req.cache_request_handle)
        flow = self._flows.get(req.cache_request_handle)
        if flow is None:
            return
        flow.kv = None
        self._unstage(flow)
        self._drop_offer(req.cache_request_handle)
        if not checkpointed and flow.match is not None and flow.admitted:
            # Released before its checkpoint (an abort): its copies returned in free_kv_row;
            # decide the load on every rank, then its L2 source pages may be evicted.
            if flow.load is not None:
                _wait_copies([flow.load])
                self.cache.poll()
            self.cache.release(flow.match.last_node)
            flow.match = None
        if not checkpointed:
            self._abort_unwritten(flow)

    def release_aborted_request(self, handle: CacheRequestHandle) -> None:
        self.counts.forget(handle)
        flow = self._flows.get(handle)
        if flow is None:
            return
        if flow.load_staged:  # never submitted: nothing writes its slots
            self._unstage(flow)
            self.cache.release(flow.match.last_node)
            flow.match = None
        if not flow.admitted:
            self._drop_offer(handle)
        self._abort_unwritten(flow)

    def reset(self) -> None:  # type: ignore[override]
        """SGLang's flush_cache: the device tree and every L2 copy are dropped."""
        super().reset()
        if not hasattr(self, "cache"):
            return  # RadixCache.__init__ resets before the plug-in exists
        for handle in list(self._flows):
            self._drop_offer(handle)
        self._flows.clear()
        self.counts.clear()
        self._read_by.clear()
        self._evicted_reads.clear()
        self._staged.clear()
        self.indices.resolve()
        self.cache.drain()
        self.cache.close(discard=True)  # the node tier's journal forgets every copy: the new cache adopts none
        self.cache = self._make_cache()
        self.copies.cache = self.cache
        if self.exporter is not None:
            self.exporter.collector.cache = self.cache

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.stop()
        self.cache.drain()
        self.cache.close()

    release_host_resources = close

    # ---- helpers -------------------------------------------------------------------------

    def _alloc_slots(self, n: int) -> torch.Tensor | None:
        allocator = self.token_to_kv_pool_allocator
        if allocator.available_size() < n:
            self.evict(EvictParams(num_tokens=n - allocator.available_size()))
        return allocator.alloc(n)

    def _finish_forward(self) -> None:
        """The finished forward's remaining backup layers and its loads' check order, from
        the scheduler thread: behind the forward stream (`fence`)."""
        if self.copies.unfinished:
            with self.fence.behind_forward():
                self.copies.finish()
        else:
            self.copies.finish()

    def _load_ok(self, req: Req, flow: _Flow) -> bool:
        """Decide the request's load (its forward waited for it); False: the request fails."""
        load = flow.load
        if load is not None:
            _wait_copies([load])
            self.cache.poll()
            if load.active:
                raise AssertionError(f"hicache-cp: load {load.id} of {req.rid} undecided after its copies returned")
        assert flow.match is not None
        self.cache.release(flow.match.last_node)
        flow.match = None
        if load is not None and load.state is LoadState.DONE:
            self.stats.loaded_tokens += flow.host_tokens
            flow.loaded_slots = None
            return True
        self.stats.failed_loads += 1
        why = flow.load_error if load is None else load.error
        message = (
            f"hicache-cp: the host-to-device load of {flow.host_tokens} tokens at token {flow.device_len} failed "
            f"after the forward read them ({why}); the request is failed, nothing of it is cached"
        )
        logger.warning("%s (request %s)", message, req.rid)
        req.skip_radix_cache_insert = True
        if req.finished():  # its output is not streamed yet (stream_output follows the results)
            req.finished_reason = FINISH_ABORT(message)
        else:
            req.to_finish = FINISH_ABORT(message)
        for op in flow.backups:
            if op.active:
                self.cache.abort_backup(op)
        return False

    def _abort_unwritten(self, flow: _Flow) -> None:
        """A request released before its forward wrote every layer: the backups that still
        miss layers can never complete (their slots go back to SGLang) and are aborted.
        Backups whose every layer was submitted copy valid KV and commit as usual."""
        unwritten = [op for op in flow.backups if op.active and op.missing_layers()]
        self.copies.forget(unwritten)
        for op in unwritten:
            self.cache.abort_backup(op)

    def _unstage(self, flow: _Flow) -> None:
        """Drop `flow`'s staged load and reservations (its slots go back before its forward)."""
        if any(item.flow is flow for item in self._staged):
            self._staged = [item for item in self._staged if item.flow is not flow]
        flow.load_staged = False

    def _refuse(self, req: Req, flow: _Flow, why: str) -> None:
        self.stats.refused_loads += 1
        logger.warning("hicache-cp: load for %s not started (%s); SGLang recomputes it", req.rid, why)
        self._drop_offer(req.cache_request_handle)

    def _drop_offer(self, handle: CacheRequestHandle) -> None:
        flow = self._flows.get(handle)
        if flow is not None and flow.match is not None and not flow.admitted:
            self.cache.release(flow.match.last_node)
            flow.match = None
            flow.host_tokens = 0

    def _insert_cache(self, req: Req, token_ids: Any, **kwargs: Any) -> tuple[Any, torch.Tensor, int]:
        """SGLang's insert; it frees the row positions [cache_protected_len, matched) whose
        prefix another request inserted first. Recorded (host values only) for `checkpoint`."""
        protected = req.kv.cache_protected_len
        out = super()._insert_cache(req, token_ids, **kwargs)
        flow = self._flows.get(req.cache_request_handle)
        if flow is not None and out[2] > protected:
            flow.freed.append((protected, out[2]))
        return out

    def _wait_for_freed_sources(self, req: Req, flow: _Flow) -> None:
        """A backup still reading slots SGLang's insert just freed as duplicates is waited
        for before they can be allocated again (the next allocation comes after this call)."""
        freed, flow.freed = flow.freed, []
        for op in flow.backups:
            if freed and op.active and self._touches(op, freed):
                self.stats.duplicate_waits += 1
                _wait_copies([op])


def _eligible(req: Req) -> bool:
    """Tokens alone identify the request's KV (no LoRA, cache salt, embeddings or images)."""
    return (
        req.extra_key is None
        and getattr(req, "cache_salt", None) is None
        and getattr(req, "input_embeds", None) is None
        and getattr(req, "multimodal_inputs", None) is None
        and getattr(req, "positional_embed_overrides", None) is None
    )


def _wait_copies(ops: list[LoadOp | BackupOp | None]) -> None:
    """Block until the ops' copies in flight returned (their outcome is decided by poll)."""
    for op in ops:
        if op is None:
            continue
        for t in op.inflight:
            try:
                t.wait()
            except Exception as exc:  # recorded: the op aborts at the next poll
                op.error = op.error or exc
