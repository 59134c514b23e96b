"""A prefill server's scheduler over `HiCache`: continuous batching, chunked prefill.

Each step builds one forward (a batch) and runs it:

    arrivals      requests enter the waiting queue at their trace timestamp
                  (scaled), or all at once ("asap")
    batch         running sequences first, in admission order, then new ones
                  (FCFS) while the batch's tokens fit `max_batch_tokens` (the
                  forward is ragged: it computes each sequence's own chunk, no
                  padding); a sequence brings at most `chunk_tokens` tokens,
                  page-aligned unless it is its last chunk
    order         `short-first` (the default): when that batch holds sequences
                  that finish within `short_tokens` (a hit request's tail) and
                  others that do not, the forward takes only the short ones,
                  fewest tokens first; the others run next. A waiting long
                  sequence gets the full batch after `SHORT_STREAK` such
                  forwards in a row, so a stream of hits cannot starve it.
                  `fcfs`: the batch as built
    queue         with `l3.prefetch_wait = false`, once the batch is built the
                  first `QUEUED_PREFETCHES` requests still waiting are
                  prefetched from L3 once each (`HiCache.prefetch_queued`):
                  their pages land in L2 during the forward (`settle` waits
                  for reads still in flight, each within its deadline) and
                  commit at its end, before they are matched
    admission     match_prefix -> load_back -> alloc_device -> reserve_backup.
                  A request is admitted only when the L1 pages of every running
                  sequence plus all of its own fit the pool (so allocation
                  never fails mid-flight); the queue waits otherwise (FCFS)
    forward       per layer: wait for the loads of every sequence of the batch
                  (its own and the ones its device prefix depends on,
                  `MatchResult.waits`), compute, store the chunk's KV in L1,
                  fire the layer hook for the backups of the sequences that end
                  here (target layers, then the draft layer)
    end of step   read the sampled tokens (the host sync), `settle()` (loads and
                  backups decided), then per sequence:
                    its load aborted     recompute from its device prefix on: the
                                         loaded pages and everything computed on
                                         them; `recomputed(load)` before insert
                    a load it waited on  (`prefix_failed`) give back its pages and
                    aborted              lock, and match again (it re-queues first)
                    last chunk done      insert (the backup attaches), verify the
                                         reused pages, PD send, release
                  then `poll()` (the inserted backups commit) and `ensure_free()`

Under CP (`hf_cp`) every rank runs this same loop on replicated decisions;
the forward reads the full prefix through the view's exchange, and each rank
writes, digests and checks only the pages it owns.

Restored pages are byte-checked at the end of the first forward that waited
on them, before their load is decided (`hf_oracle.RestoreGuard`): a
mismatch fails the load and the request recomputes (the hit is refused).

A request's backup covers all its new pages; its layer hooks fire in the
forward of its last chunk, when every page is written. The trailing partial
page of a prompt is computed but not cached. Every chunk after a sequence's
first starts one position before the first it writes: a request that reuses
R tokens computes from R - 1 on (`resume_position`), a later chunk from the
previous one's last position. The MTP draft's next entry reads the target's
hidden state there (`hf_forward`: the draft runs one position ahead), and a
fully cached prompt needs its last position's logits anyway. That position's
KV is recomputed, not written again (the stored copy stays as computed, as
the digests recorded it); the recomputed token rides along beyond the
chunk's token budget.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache_cp.cache import HiCache, MatchResult
from hicache_cp.cp import mapping as cp_mapping
from hicache_harness.engines.hf_cp import KVView, LocalView
from hicache_harness.engines.hf_forward import PagedForward, SeqChunk, SeqPlan
from hicache_harness.engines.hf_oracle import DigestBook, Digester, IntegrityTally, RestoreGuard, UnitMismatch
from hicache_harness.engines.hf_timing import LoadTimer, Clock
from hicache_harness.engines.sequences import RequestRecord, Seq, SeqState
from hicache_harness.trace import TraceRequest
from hicache_cp.layout import Model
from hicache_cp.ops import BackupOp, BackupState, LoadOp, LoadState
from hicache_cp.keys import prefix_hashes

logger = logging.getLogger(__name__)


#: Short-only forwards in a row while longer sequences wait, before they get one.
SHORT_STREAK = 4
#: With an L3 tier that does not wait, the queue's first requests whose L3
#: continuation is fetched while they wait: a window, since under "asap"
#: arrivals the whole trace is queued at once and would overfill L2.
QUEUED_PREFETCHES = 2


class Order(enum.Enum):
    FCFS = "fcfs"  # the batch as built: running sequences, then new ones
    SHORT_FIRST = "short-first"  # sequences about to finish go first (module docstring)


class Arrivals(enum.Enum):
    ASAP = "asap"  # every request is waiting at time 0, in trace order
    TRACE = "trace"  # at its timestamp (times --time-scale) after the first


@dataclass(frozen=True)
class SchedulerOptions:
    chunk_tokens: int
    max_batch_tokens: int
    arrivals: Arrivals = Arrivals.ASAP
    time_scale: float = 1.0
    use_l2: bool = True  # False: never back up (the --compare-no-l2 run)
    verify: bool = True
    order: Order = Order.SHORT_FIRST
    short_tokens: int = 0  # a sequence this close to its first token is short; 0: chunk_tokens // 2

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1 or self.max_batch_tokens < 1:
            raise ValueError(f"chunk_tokens and max_batch_tokens must be >= 1, got {self.chunk_tokens}, {self.max_batch_tokens}")
        if self.short_tokens < 0:
            raise ValueError(f"short_tokens must be >= 0, got {self.short_tokens}")
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):  # nan or inf: no arrival ever comes
            raise ValueError(f"time_scale must be a finite number > 0, got {self.time_scale}")

    @property
    def short_limit(self) -> int:
        """Tokens left within which a sequence counts as short."""
        return self.short_tokens or max(1, self.chunk_tokens // 2)


class _BatchHooks:
    """The forward's layer hooks for one batch: waits before, backups after."""

    def __init__(self, cache: HiCache, loads: list[LoadOp], backups: list[BackupOp | None], pd: Any = None) -> None:
        self.cache = cache
        self.loads = loads
        self.backups = backups
        self.pd = pd  # the PD sink: sends per layer (`pd_per_layer`) from these same hooks, or times the forward

    def before_layer(self, model: Model, layer: int) -> None:
        for op in self.loads:
            op.wait_layer(layer, model)

    def after_layer(self, model: Model, layer: int) -> None:
        self.cache.on_layer_end(model, layer, self.backups)
        if self.pd is not None:
            self.pd.on_layer_end(model, layer)


@dataclass
class BatchStats:
    forwards: int = 0
    max_batch_requests: int = 0
    max_batch_tokens: int = 0
    batch_requests_sum: int = 0
    computed_tokens: int = 0
    forward_s: float = 0.0


@dataclass
class ServeResult:
    """Everything the scheduler measured, cumulative over all its `serve` calls."""

    records: list[RequestRecord]
    integrity: IntegrityTally
    batches: BatchStats
    rejected: int
    restarts: int
    redone: int
    logits: dict[int, Any] = field(default_factory=dict)  # request -> last-token logits (CPU float32)
    wall_s: float = 0.0
    draft_logits: dict[int, Any] = field(default_factory=dict)  # request -> the MTP draft's last-token logits


class Scheduler:
    """Serves a list of requests through `HiCache` with the real model; see the module docstring."""

    def __init__(
        self,
        cache: HiCache,
        forward: PagedForward,
        buffers: dict[Any, list[Any]],
        options: SchedulerOptions,
        *,
        sink: Any = None,
        on_request: Callable[[int], None] | None = None,
        clock: Clock | None = None,
        view: KVView | None = None,
        on_finish: Callable[[Seq], None] | None = None,
        before_load: Callable[[int, MatchResult], None] | None = None,
    ) -> None:
        """`view`: how forwards read KV (`hf_cp`; default: the L1 pools, CP 1).
        `on_finish(seq)`: after a request's first token, while it still holds its pages.
        `before_load(request, match)`: before a match with an L2 continuation is loaded
        (the fault injector's hook, `hf_faults`)."""
        self.view = view or LocalView(buffers)
        if (self.view.cp_size, self.view.rank) != (cache.cp_size, cache.rank):
            raise ValueError(f"a view of rank {self.view.rank} of CP {self.view.cp_size} over the cache of "
                             f"rank {cache.rank} of CP {cache.cp_size}")  # fmt: skip
        self.on_finish = on_finish
        self.before_load = before_load
        self.cache = cache
        self.forward = forward
        self.buffers = buffers
        self.opt = options
        self.sink = sink
        self.on_request = on_request or (lambda i: None)
        self.clock = clock or Clock(forward.m.device)
        self.ps = cache.layout.page_size
        self.digester = Digester(cache.layout, cache.device_pool)
        self.book = DigestBook(self.digester.num_units)
        self.integrity = IntegrityTally()
        self.guard = RestoreGuard(self.digester, self.book, self.integrity, rank=cache.rank, cp_size=cache.cp_size)
        self.stats = BatchStats()
        self.waiting: deque[tuple[TraceRequest, np.ndarray, RequestRecord]] = deque()
        self.running: list[Seq] = []
        self.records: list[RequestRecord] = []
        self.logits: dict[int, Any] = {}
        self.draft_logits: dict[int, Any] = {}
        self.rejected = 0
        self.restarts = 0
        self.redone = 0
        self._short_streak = 0
        self._prefetch_queued = cache.l3 is not None and not cache.config.l3.prefetch_wait
        self._prefetched: set[int] = set()  # requests whose queued prefetch started

    # ---- the loop ----------------------------------------------------------------------------

    def serve(self, requests: list[tuple[TraceRequest, np.ndarray]]) -> ServeResult:
        """Serve every request to its first token; returns when all are done."""
        arrivals = deque(self._arrival_times(requests))
        t0 = self.clock.now()
        done = 0
        while arrivals or self.waiting or self.running:
            now = self.clock.now() - t0
            while arrivals and arrivals[0][0] <= now:
                at, req, ids = arrivals.popleft()
                rec = RequestRecord(req.index, len(ids), 0, 0, arrival_s=at, page_size=self.ps)
                self.waiting.append((req, ids, rec))
            if not self.waiting and not self.running:
                time.sleep(max(0.0, arrivals[0][0] - now))
                continue
            batch = self._build_batch(now)
            self._prefetch_waiting()
            if not batch:
                if not self.running and self.waiting:
                    self._reject_head()
                continue
            finished = self._step(batch, t0)
            for seq in finished:
                self.records.append(seq.record)
                self.on_request(done)
                done += 1
        self.integrity.digest_variants = self.book.variants
        return ServeResult(
            self.records, self.integrity, self.stats, self.rejected, self.restarts, self.redone,
            self.logits, self.clock.now() - t0, self.draft_logits,
        )  # fmt: skip

    def _arrival_times(self, requests: list[tuple[TraceRequest, np.ndarray]]) -> list[tuple[float, TraceRequest, np.ndarray]]:
        if self.opt.arrivals is Arrivals.ASAP or not requests:
            return [(0.0, r, ids) for r, ids in requests]
        first = min(r.timestamp_ms for r, _ in requests)
        timed = [((r.timestamp_ms - first) / 1000 * self.opt.time_scale, r, ids) for r, ids in requests]
        return sorted(timed, key=lambda t: t[0])

    # ---- batching and admission --------------------------------------------------------------

    def _prefetch_waiting(self) -> None:
        """Start the L3 prefetch of the queue's first requests (see the module docstring).
        Replicated: the queue is the same on every CP rank."""
        if not self._prefetch_queued:
            return
        for req, ids, _ in itertools.islice(self.waiting, QUEUED_PREFETCHES):
            if req.index not in self._prefetched:
                self._prefetched.add(req.index)
                self.cache.prefetch_queued(ids)

    def _build_batch(self, now: float) -> list[tuple[Seq, int]]:
        batch = self._fcfs_batch(now)
        return self._short_first(batch) if self.opt.order is Order.SHORT_FIRST else batch

    def _fcfs_batch(self, now: float) -> list[tuple[Seq, int]]:
        """Running sequences first, then admissions, while the batch's tokens
        stay within `max_batch_tokens`."""
        batch: list[tuple[Seq, int]] = []
        for seq in self.running:
            q = self._take(seq, batch)
            if q:
                batch.append((seq, q))
        while self.waiting and self._room(batch) >= self.ps:
            seq = self._admit(now)
            if seq is None:
                break
            q = self._take(seq, batch)
            if q:
                batch.append((seq, q))
        return batch

    def _short_first(self, batch: list[tuple[Seq, int]]) -> list[tuple[Seq, int]]:
        """Only the sequences that finish within `short_limit`, fewest tokens
        first, when the batch also holds longer ones (and they have not waited
        `SHORT_STREAK` forwards already)."""
        short = [(seq, q) for seq, q in batch if seq.remaining <= self.opt.short_limit]
        if not short or len(short) == len(batch) or self._short_streak >= SHORT_STREAK:
            self._short_streak = 0
            return batch
        self._short_streak += 1
        return sorted(short, key=lambda e: e[0].remaining)

    def _room(self, batch: list[tuple[Seq, int]]) -> int:
        """Tokens one more sequence may bring to this forward."""
        return max(0, self.opt.max_batch_tokens - sum(q for _, q in batch))

    def _take(self, seq: Seq, batch: list[tuple[Seq, int]]) -> int:
        room = self._room(batch)
        return seq.next_chunk(room, self.opt.chunk_tokens, self.ps) if room else 0

    def _held_pages(self) -> int:
        """L1 pages the running sequences hold (shared prefix pages once)."""
        if not self.running:
            return 0
        return len(np.unique(np.concatenate([seq.table for seq in self.running])))

    def _admit(self, now: float) -> Seq | None:
        """Admit the head of the queue, or None when L1 cannot hold it yet."""
        cache, ps = self.cache, self.ps
        req, ids, rec = self.waiting[0]
        n_pages = len(ids) // ps
        capacity = cache.device_pool.allocator.capacity
        if self._held_pages() + n_pages > capacity:
            return None
        self.waiting.popleft()
        m = cache.match_prefix(ids, request=req.index)
        if m.host_len and self.before_load is not None:
            self.before_load(req.index, m)
        timer = LoadTimer.before_load(self.clock) if m.host_len else None
        load = cache.load_back(m)
        if load is not None and timer is not None:
            rec.load_submit_s = timer.started(load)
        matched = m.matched_pages
        new = cache.alloc_device(n_pages - matched, matched)
        if new is None:  # cannot happen under the admission check; undo and wait
            logger.warning("request %d: L1 refused %d pages despite the admission check", req.index, n_pages - matched)
            self._finish_load(load)
            cache.release(m.last_node)
            self.waiting.appendleft((req, ids, rec))
            return None
        backup = cache.reserve_backup(new, matched) if self.opt.use_l2 else None
        loaded = load.device_pages if load is not None else np.empty(0, np.int64)
        table = np.concatenate([m.device_pages, loaded, new])
        rec.l1_hit_pages, rec.l2_hit_pages = m.device_len, m.host_len
        rec.waited_loads = len(m.waits)
        rec.admitted_s = now
        rec.load_bytes = (load.local_pages if load is not None else 0) * cache.layout.bytes_per_page  # this rank's
        seq = Seq(
            req, ids, prefix_hashes(ids, ps), m, load, new, backup, table,
            cp_mapping.to_physical(table, cache.cp_size), rec, progress=matched * ps,
            write_page=matched, reuse_pages=matched, timer=timer if load is not None else None,
        )  # fmt: skip
        self.running.append(seq)
        return seq

    def _reject_head(self) -> None:
        req, ids, rec = self.waiting.popleft()
        rec.served = False
        self.records.append(rec)
        self.rejected += 1
        logger.warning("request %d rejected: its %d pages exceed L1 (%d pages)", req.index, len(ids) // self.ps,
                       self.cache.device_pool.allocator.capacity)  # fmt: skip

    # ---- one step ----------------------------------------------------------------------------

    def _step(self, batch: list[tuple[Seq, int]], t0: float) -> list[Seq]:
        cache = self.cache
        chunks = [seq.chunk(q, self.ps) for seq, q in batch]
        plans = [SeqPlan.build(c, self.ps) for c in chunks]
        loads: list[LoadOp] = []
        for seq, _ in batch:
            for op in [*seq.m.waits, *([seq.load] if seq.load is not None else [])]:
                if op.active and op not in loads:
                    loads.append(op)
        enders = [seq for (seq, _), c in zip(batch, chunks) if c.final]
        backups = [seq.backup for seq in enders if seq.backup is not None]
        for seq in enders:
            seq.hooked = seq.backup is not None
        pd = self.sink if hasattr(self.sink, "begin_request") else None  # the PD sink (sends per layer or times)
        for seq in enders if pd is not None else ():  # rooms open before the forward whose hooks send
            pd.begin_request(seq.req.index, seq.m, seq.new, seq.hashes)
        t_start = self.clock.now()
        stores = self.view.stores([(seq.table, p) for (seq, _), p in zip(batch, plans)])
        hooks = self.view.hooks(_BatchHooks(cache, loads, backups, pd), stores)
        result = self.forward.run(list(zip(plans, stores)), hooks)
        logits = result.logits.cpu()  # reading the first tokens: the end-of-forward sync
        draft = result.draft_logits.cpu() if result.draft_logits is not None else None
        t_token = self.clock.sync() - t0
        self._tally_batch(plans, t_start, t_token + t0)
        self._record_digests(batch, chunks)
        if self.opt.verify:
            self._guard_loads()
        cache.settle()
        rows = {b: i for i, b in enumerate(result.final_rows)}
        for b, ((seq, q), chunk) in enumerate(zip(batch, chunks)):
            seq.record.computed_tokens += q
            if seq.record.first_forward < 0:
                seq.record.first_forward = self.stats.forwards - 1
            redo = seq.load is not None and seq.load.state is LoadState.ABORTED and seq.redo_load is None
            if pd is not None and chunk.final and (redo or seq.m.prefix_failed):
                pd.abandon(seq.req.index, "its load aborted; recomputed")  # what the hooks sent is void
            if redo:
                self._redo(seq)
            elif seq.m.prefix_failed:
                self._restart(seq)
            elif chunk.final:
                seq.record.first_token_s = t_token
                self._finish(seq, logits[rows[b]], draft[rows[b]] if draft is not None else None)
            else:
                seq.progress = chunk.end
        cache.poll()
        cache.ensure_free()
        finished = [seq for seq in self.running if seq.state is SeqState.DONE]
        self.running = [seq for seq in self.running if seq.state is SeqState.RUNNING]
        return finished

    def _tally_batch(self, plans: list[SeqPlan], t_start: float, t_end: float) -> None:
        s = self.stats
        tokens = sum(p.tokens for p in plans)
        s.forwards += 1
        s.max_batch_requests = max(s.max_batch_requests, len(plans))
        s.max_batch_tokens = max(s.max_batch_tokens, tokens)
        s.batch_requests_sum += len(plans)
        s.computed_tokens += tokens
        s.forward_s += t_end - t_start

    def _record_digests(self, batch: list[tuple[Seq, int]], chunks: list[SeqChunk]) -> None:
        """Digest every page this forward wrote (one batched pass, one host sync);
        each sequence keeps its own until insert. Always on: the decode peer
        verifies PD transfers against the same digests."""
        owners: list[tuple[Seq, np.ndarray]] = []
        for (seq, _), c in zip(batch, chunks):
            if c.write_to > c.write_from:
                pos = self._mine(seq, np.arange(c.write_from // self.ps, c.write_to // self.ps))
                if len(pos):
                    owners.append((seq, pos))
        if not owners:
            return
        rows = self.digester.digests(np.concatenate([seq.pages[pos] for seq, pos in owners]))
        i = 0
        for seq, pos in owners:
            for p in pos.tolist():
                seq.digests[p] = rows[i]
                i += 1

    def _mine(self, seq: Seq, positions: np.ndarray) -> np.ndarray:
        """The page positions of `seq` among `positions` that this rank owns (all at CP 1)."""
        return positions[cp_mapping.owned_mask(seq.table[positions], self.cache.rank, self.cache.cp_size)]

    def _guard_loads(self) -> None:
        """Byte-check every load not checked yet before the poll decides it
        (`RestoreGuard`): settle would wait for its copies anyway. A load that
        already failed a copy is left to abort."""
        layout = self.cache.layout
        for seq in self.running:
            load = seq.load
            if load is None or seq.load_checked or not load.active:
                continue
            seq.load_checked = True
            for model in (Model.TARGET, Model.DRAFT):
                for layer in range(layout.num_layers(model)):
                    load.wait_layer(layer, model)
            if load.error is None:
                self.guard.check(seq.req.index, load, seq.hashes)

    def _keep_digests(self, seq: Seq, node: Any) -> None:
        """Record the digests of the pages of `seq` the tree kept after its insert."""
        if not seq.digests:
            return
        tree = _tree_pages(node, seq.n_pages)
        kept = [p for p in sorted(seq.digests) if tree[p] == seq.table[p]]
        if kept:
            self.book.record(seq.hashes[kept], np.stack([seq.digests[p] for p in kept]))
        seq.digests.clear()

    # ---- the ends of a sequence --------------------------------------------------------------

    def _redo(self, seq: Seq) -> None:
        """Its own load aborted: the loaded pages and all it computed on them are
        garbage. Recompute from the device prefix on, into the same pages."""
        assert seq.load is not None
        self.redone += 1
        seq.record.redone = True
        seq.redo_load = seq.load
        seq.write_page = seq.reuse_pages = seq.m.device_len
        seq.progress = seq.m.device_len * self.ps
        if seq.hooked and seq.backup is not None:  # its copies carry the garbage
            self.cache.abort_backup(seq.backup)
            seq.backup = self.cache.reserve_backup(seq.new, seq.m.matched_pages) if self.opt.use_l2 else None
            seq.hooked = False
        logger.warning("request %d: its load aborted; recomputing from page %d", seq.req.index, seq.write_page)

    def _restart(self, seq: Seq) -> None:
        """A load its device prefix waited on aborted: give everything back and
        match again (it goes first in the queue)."""
        cache = self.cache
        self.restarts += 1
        seq.record.restarts += 1
        if seq.backup is not None and seq.backup.state in (BackupState.RESERVED, BackupState.WRITING):
            cache.abort_backup(seq.backup)
        cache.free_device(seq.new)
        cache.release(seq.m.last_node)
        seq.state = SeqState.RESTARTED
        seq.record.computed_tokens = 0
        self.waiting.appendleft((seq.req, seq.ids, seq.record))
        logger.warning("request %d: a load its prefix read aborted; matching again", seq.req.index)

    def _finish(self, seq: Seq, logits: Any, draft_logits: Any = None) -> None:
        cache = self.cache
        if seq.redo_load is not None:
            cache.recomputed(seq.redo_load)
        node = cache.insert(seq.m, seq.new, backup=seq.backup)
        own = dict(seq.digests)  # the pages this request computed (the tree may keep another copy)
        self._keep_digests(seq, node)
        if seq.timer is not None:
            seq.record.load_s = seq.timer.elapsed_s()
        if self.opt.verify and seq.reuse_pages:
            self._verify(seq)
        seq.record.reused_pages = seq.reuse_pages
        self.logits[seq.req.index] = logits
        if draft_logits is not None:
            self.draft_logits[seq.req.index] = draft_logits
        if self.on_finish is not None:
            self.on_finish(seq)
        if self.sink is not None:  # the PD sender: the decode peer checks every unit against the digests
            digests = self.book.expected(seq.hashes)
            if getattr(self.sink, "per_layer", False):  # the hooks sent this request's own copies
                for p, d in own.items():
                    digests[p] = np.asarray(d)[None]
            self.sink.send_request(seq.req.index, node, seq.hashes, cache, digests=digests)
        cache.release(node)
        seq.state = SeqState.DONE

    def _finish_load(self, load: LoadOp | None) -> None:
        while load is not None and load.active:
            self.cache.settle()

    def _verify(self, seq: Seq) -> None:
        """Byte oracle: every unit of every reused page against the recorded digests."""
        pos = self._mine(seq, np.arange(seq.reuse_pages))
        t = self.integrity
        t.expected_units += len(pos) * self.digester.num_units
        if not len(pos):
            return
        digests = self.digester.digests(seq.pages[pos])
        ok = self.book.check(seq.hashes[pos], digests)
        t.checked_pages += len(pos)
        t.checked_units += ok.size
        device_len = seq.m.device_len
        t.checked_l2_units += int((pos >= device_len).sum()) * self.digester.num_units
        bad = np.argwhere(~ok)
        if len(bad):
            units, rank = self.digester.units, self.cache.rank
            t.add([
                UnitMismatch(seq.req.index, int(pos[i]), units[u][0].part.value, units[u][1],
                             "l1" if pos[i] < device_len else "l2", rank)
                for i, u in bad
            ])  # fmt: skip


def resume_position(reused_pages: int, page_size: int, n_tokens: int) -> int:
    """The first position a request computes when it reuses `reused_pages` whole
    pages of its `n_tokens`: the last reused one (module docstring), or 0
    (`Seq.start` of a newly admitted sequence)."""
    return max(0, min(reused_pages * page_size, n_tokens) - 1)


def _tree_pages(node: Any, n: int) -> np.ndarray:
    """Logical L1 page of positions [0, n) along the tree path ending at `node` (-1: none)."""
    out = np.full(n, -1, np.int64)
    while node.parent is not None:  # the root holds no pages
        lo = node.first_position
        if node.device_pages is not None and lo < n:
            hi = min(n, lo + node.num_pages)
            out[lo:hi] = node.device_pages[: hi - lo]
        node = node.parent
    return out
