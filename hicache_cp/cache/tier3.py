"""Tier3: the L3 tier (a shared object store, Mooncake Store) below L2.

Two flows, each an explicit state machine (`hicache_cp.l3.ops`):

    prefetch(match)   after the L1 prefix and the L2 continuation: look up the
                      L3 continuation (this rank's objects), agree on its length
                      (MIN over the CP group: a page counts only if every rank
                      that owns it has all its parts), reserve L2 pages and read
                      the objects into them. The pages stay the op's, invisible,
                      until the poll that agrees every object landed whole on
                      every rank; then they join the tree as committed L2 copies
                      (all parts at once). A request can wait for that (best
                      effort within the deadline; the match then grows by the
                      fetched pages) or go without (the pages serve later
                      requests). A failure, a passed deadline or a cancel aborts
                      the op on every rank together and releases its pages.
    prefetch_queued   the same for a request that is queued, not scheduled yet
                      (`HiCache.prefetch_queued`): never waits; what landed by
                      the time the request is matched is in L2 for it.
    claim(m)          a match uses host copies: the pages among them that an L3
                      prefetch committed and no request used yet count as L3
                      hits (once per landed copy; `fresh`), the rest as L2 hits.
    on_committed(n)   a backup committed: queue a write-back of the node's pages
                      (policy: hit at least `write_min_hits` times; the queue is
                      bounded in pages and skips what does not fit; keys already
                      in L3 are skipped by the worker). The job holds its L2 pages:
                      L2 eviction takes them out of the tree at once but frees
                      them only when the job retires (`on_evict_l2`). A backup
                      that finds no room in L2 takes evicted pages back from the
                      jobs whose puts have not started (`yield_queued_puts`), so
                      the queue never starves L2 of new copies.

Both kinds of op vote in the cache's one agreement per poll (`Lifecycle.poll`
lists them after the backups and loads), so every rank applies the same
decision at the same step. Creating them is a replicated decision too (it
reads only replicated state); what a rank's store call did is rank-local and
only reaches the others through the votes.

The store is optional at every step: while it is unreachable (`L3Client`
health DOWN) lookups answer "absent", prefetches and puts are not issued,
and the cache serves from L1 and L2; it resumes when a probe answers.

Runs in: the cache's thread; the store calls run on `L3Client`'s workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

import numpy as np

from hicache_cp.cache.eviction import Evictor
from hicache_cp.cache.l3_hits import L3Hits
from hicache_cp.cache.store_events import StoreEvents
from hicache_cp.match import MatchResult
from hicache_cp.cache.state import CacheState
from hicache_cp.cp import mapping as cp_mapping
from hicache_cp.cp.agreement import Vote
from hicache_cp.events import Medium
from hicache_cp.checksum import Verify
from hicache_cp.keys import prefix_hashes
from hicache_cp.l3.client import L3Client, PutOutcome
from hicache_cp.l3.config import L3Config
from hicache_cp.l3.keys import KeyScheme, L3Object, PositionHashes, chain_hashes
from hicache_cp.l3.metrics import L3Metrics
from hicache_cp.l3.ops import PrefetchOp, PrefetchState, WriteJob, WriteState
from hicache_cp.l3.store import L3Error, L3Timeout
from hicache_cp.ops import LoadOp
from hicache_cp.radix import HostState, Node

logger = logging.getLogger(__name__)

#: End-of-node chain hashes kept (node id -> hash); cleared when it grows past this.
_HASH_MEMO_LIMIT = 1 << 18


class L3Observer(Protocol):
    """Optional hooks for a harness (cross-instance accounting). Called on the cache's thread."""

    def on_l3_put_started(self, keys: list[str]) -> None:
        """This rank submitted a put of these object keys (they may show up in the store before it retires)."""

    def on_l3_put(self, keys: list[str], stored: list[str]) -> None:
        """The put of `keys` (from `on_l3_put_started`) retired; this rank stored
        `stored` of them (the others were present already, failed or yielded)."""

    def on_l3_hit(self, page_keys: list[tuple[str, ...]]) -> None:
        """A request got these pages from L3: per page, the keys of this rank's objects holding it."""


class Tier3:
    """The L3 tier of one cache rank; see the module docstring."""

    def __init__(self, state: CacheState, evictor: Evictor, client: L3Client, config: L3Config) -> None:
        self.s = state
        self.evictor = evictor
        self.client = client
        self.scheme: KeyScheme = client.scheme
        self.config = config
        self.metrics: L3Metrics = client.metrics
        self.observer: L3Observer | None = None
        self.events: StoreEvents | None = None  # STORE events, when the cache has an event log
        self.prefetches: list[PrefetchOp] = []  # active, creation order (the agreement's order)
        self.writes: list[WriteJob] = []  # active, creation order
        capacity = state.host_pool.allocator.capacity
        self.held = np.zeros(capacity + 1, dtype=np.int32)  # logical L2 page -> write jobs holding it
        self.deferred = np.zeros(capacity + 1, dtype=bool)  # evicted while held: freed when released
        self.queued_pages = 0
        #: Which L2 copies an L3 prefetch landed and no match used yet (`claim`).
        self.hits = L3Hits(state, self.metrics, capacity)
        #: Write-back bound in pages: what puts in flight may hold of L2 (replicated).
        self.queue_limit = config.write_queue_pages or max(1, capacity // 4)
        self._end_hash: dict[int, tuple[int, bytes]] = {}

    @property
    def busy(self) -> bool:
        """Prefetches or write-backs still active (their counters are not final yet)."""
        return bool(self.prefetches or self.writes)

    def claim(self, m: MatchResult) -> None:
        """`match_prefix(m)` used host copies: the landed ones count as L3 hits (`L3Hits.claim`)."""
        self.hits.claim(m, self.observer)

    def note_load(self, m: MatchResult, load: LoadOp | None) -> None:
        """`load_back(m)` ran (`L3Hits.note_load`)."""
        self.hits.note_load(m, load)

    # ---- prefetch ----------------------------------------------------------------------------

    def prefetch(self, m: MatchResult, wait: bool) -> PrefetchOp | None:
        """Start fetching the L3 continuation of `m`; see `HiCache.prefetch`.

        Costs one lookup (bounded by `lookup_timeout_s`) and, when anything
        could be fetched, one MIN collective (every rank calls this at the
        same step). Returns None when there is nothing to fetch, the store
        is down, L2 cannot make room, or (not waiting) an active prefetch
        already fetches from `m`'s end."""
        self._write_on_hits(m)
        return self._start(m, wait)

    def prefetch_queued(self, m: MatchResult) -> PrefetchOp | None:
        """`prefetch(m, wait=False)` for a queued request's `m` from
        `Prefixes.peek` (no hit was counted, so no write-back is due)."""
        return self._start(m, wait=False)

    def _start(self, m: MatchResult, wait: bool) -> PrefetchOp | None:
        s, g = self.s, self.scheme.group
        m.l3_checked = True
        self.client.tick()
        ps = s.layout.page_size
        start, n = m.matched_pages, m.num_pages
        if start < n and m.tokens[start * ps : (start + 1) * ps].tobytes() in m.last_node.children:
            return None  # the tree goes on (a pending copy, stale pages): no L3 read under it
        if not wait and self._fetching(m.tokens, start) is not None:
            return None  # a queued request's prefetch already reads it; it lands in L2 for this one too
        groups = self.scheme.whole_groups(start, n)
        if groups.stop * g - start < self.config.prefetch_min_pages:
            return None
        s0 = groups.start * g
        hashes = self._request_hashes(m, s0, groups.stop * g)
        objects = self.scheme.objects(hashes, groups)
        found = self.client.lookup(objects)
        if self.events is not None and found is not None:
            self.events.looked_up(objects, found)
        local = self._leading_present(objects, found, s0, groups.stop * g)
        agreed = s.agreement.min_int(local) if s.cp_size > 1 else local
        end = s0 + agreed // g * g
        if end - start < self.config.prefetch_min_pages:
            return None
        if not self.evictor.make_room("l2", end - s0, s0):
            self.metrics.l3_prefetch_no_room += 1
            return None
        host = s.host_pool.allocator.alloc(end - s0, s0)
        assert host is not None
        mine = [o for o in objects if o.group < end // g]
        op = PrefetchOp(m.tokens[: end * ps], s0, start, host, mine,
                        deadline=time.monotonic() + self.config.prefetch_timeout_s,
                        hold_s=self.config.hold_after_unsafe_failure_s)  # fmt: skip
        self.prefetches.append(op)
        self.metrics.l3_prefetch_started += 1
        if not mine:
            pass  # this CP rank owns none of the pages
        elif self.client.up:
            op.future = self.client.submit_get(mine, [self._physical(host, s0, o) for o in mine])
        else:
            op.error = L3Error("get", "store down")
        op.transition(PrefetchState.FETCHING)
        if wait:
            op.match = m
        logger.debug("rank %d: prefetch %d of positions [%d, %d) started", s.rank, op.id, s0, end)
        return op

    def _fetching(self, tokens: np.ndarray, start: int) -> PrefetchOp | None:
        """An active prefetch reading position `start` of `tokens` (its tokens
        are a prefix of them). O(active prefetches x their tokens), numpy."""
        for op in self.prefetches:
            if (op.state is PrefetchState.FETCHING and op.first_position <= start < op.end
                    and len(tokens) >= len(op.tokens) and np.array_equal(tokens[: len(op.tokens)], op.tokens)):
                return op
        return None

    def wait_local(self, op: PrefetchOp) -> None:
        """Block until this rank's read of `op` returned or its deadline passed."""
        if op.future is not None and not op.future.done():
            try:
                op.future.result(timeout=max(0.0, op.deadline - time.monotonic()))
            except FutureTimeout:
                pass
            except Exception:  # recorded by the op's vote
                pass

    def cancel(self, op: PrefetchOp) -> None:
        """Ask for an abort (agreed at the next poll); the pages are released
        once the read returned on every rank."""
        if op.state is PrefetchState.FETCHING:
            op.cancelled = True

    def _leading_present(self, objects: list[L3Object], found: list[bool] | None, lo: int, hi: int) -> int:
        """How many positions from `lo` are present as far as this rank knows
        (every object of this rank holding the position exists; positions of
        other ranks count as present)."""
        if found is None:
            return 0
        g = self.scheme.group
        group_ok = np.ones(hi // g - lo // g, dtype=bool)
        for obj, ok in zip(objects, found):
            if not ok:
                group_ok[obj.group - lo // g] = False
        pos = np.arange(lo, hi)
        ok_pos = group_ok[pos // g - lo // g]
        if self.s.cp_size > 1:
            ok_pos |= pos % self.s.cp_size != self.s.rank
        bad = np.flatnonzero(~ok_pos)
        return int(bad[0]) if len(bad) else hi - lo

    def _physical(self, host: np.ndarray, first: int, obj: L3Object) -> np.ndarray:
        return cp_mapping.to_physical(host[obj.positions - first], self.s.cp_size)

    # ---- decisions (from Lifecycle.poll) ---------------------------------------------------

    def poll_ops(self) -> list[PrefetchOp | WriteJob]:
        """The ops that vote in this poll, in the agreement's order."""
        self.client.tick()
        return [*self.prefetches, *self.writes]

    def decide(self, decisions: Sequence[tuple[PrefetchOp | WriteJob, Vote]]) -> None:
        """Apply the agreed votes: commit/abort prefetches, retire write jobs."""
        for op, vote in decisions:
            if isinstance(op, PrefetchOp):
                self._decide_prefetch(op, vote)
            elif vote.settled:
                self._retire(op)
        self.prefetches = [op for op in self.prefetches if op.active]
        self.writes = [job for job in self.writes if job.active]
        self.hits.correct_aborted_loads()

    def _decide_prefetch(self, op: PrefetchOp, vote: Vote) -> None:
        if vote.ok and vote.settled:
            self._commit(op)
        elif not vote.ok:
            if op.state is PrefetchState.FETCHING:
                op.transition(PrefetchState.FAILING)
                self._count_failure(op)
            if vote.settled:
                self._abort(op)

    def _count_failure(self, op: PrefetchOp) -> None:
        err = op.error
        if op.cancelled and err is None:
            self.metrics.l3_prefetch_cancelled += 1
            return
        if isinstance(err, L3Timeout):
            self.metrics.l3_prefetch_timeouts += 1
        if isinstance(err, BaseException):
            self.client.failed(err)

    def _abort(self, op: PrefetchOp) -> None:
        s = self.s
        op.transition(PrefetchState.ABORTED)
        if op.quarantined:
            self.metrics.l3_quarantined_ops += 1
            logger.error("rank %d: prefetch %d failed with I/O possibly in flight: its %d L2 pages were held "
                         "%.0f s before release: %s", s.rank, op.id, op.num_pages, op.hold_s, op.error)  # fmt: skip
        s.free_host_pages(op.host_pages)
        self.metrics.l3_prefetch_aborted += 1
        logger.warning("rank %d: prefetch %d of %d pages aborted, the request goes without it: %s",
                       s.rank, op.id, op.num_pages, op.error or "failed on another rank")  # fmt: skip

    def _commit(self, op: PrefetchOp) -> None:
        """Hand the fetched pages to the tree: new host-only nodes past the
        tree's end, host copies for nodes that have none, the rest freed.
        (When the prefix they continue was evicted meanwhile, all are freed.)
        The attached pages are `fresh`: their first use counts as an L3 hit."""
        s = self.s
        op.transition(PrefetchState.COMMITTED)
        self.metrics.l3_prefetch_committed += 1
        self.metrics.l3_get_bytes += op.nbytes
        path, partial = self._walk(op.tokens)
        if s.config.verify_restores is not Verify.OFF:  # the fetched copies' identity (`HostPool.tags`)
            s.host_pool.set_tags(op.host_pages, prefix_hashes(op.tokens, s.layout.page_size)[op.first_position :])
        attached = np.zeros(op.num_pages, dtype=bool)
        for node in path:
            if node.first_position < op.start or node.host_state is not HostState.NONE or node.load is not None:
                continue  # the request's cached prefix, or a node with a host copy already
            lo, hi = node.first_position - op.first_position, node.end_position - op.first_position
            s.commit_host_copy(node, op.host_pages[lo:hi].copy())
            attached[lo:hi] = True
        reach = path[-1].end_position if path else 0
        if partial is None and op.start <= reach < op.end:  # past the tree's end: a new host-only node
            parent = path[-1] if path else s.tree.root
            ps = s.layout.page_size
            child = s.tree.add_host_child(parent, op.tokens[reach * ps :], op.host_pages[reach - op.first_position :],
                                          s.all_parts)  # fmt: skip
            if s.events is not None:
                s.events.stored(Medium.HOST, child)
            attached[reach - op.first_position :] = True
        self.hits.mark(op, attached, self.observer)
        if not attached.all():  # the cached head of a group, copies the tree has, a prefix evicted meanwhile
            s.free_host_pages(op.host_pages[~attached])
            self.metrics.l3_surplus_pages += int((~attached).sum())
        self.metrics.l3_prefetch_pages += op.num_pages
        if op.match is not None:
            self._extend(op.match, op)
        logger.debug("rank %d: prefetch %d committed (%d pages)", s.rank, op.id, op.num_pages)

    def _extend(self, m: MatchResult, op: PrefetchOp) -> None:
        """Grow the waiting request's match by the host-only nodes now after it."""
        s = self.s
        path, _ = self._walk(op.tokens)
        if m.last_node is s.tree.root:
            after = path
        elif m.last_node in path:
            after = path[path.index(m.last_node) + 1 :]
        else:
            return
        ext: list[Node] = []
        for node in after:
            if node.on_device or not node.host_visible or node.load is not None or node.stale_load is not None:
                break
            ext.append(node)
        if not ext:
            return
        s.tree.lock(ext[-1])
        s.tree.unlock(m.last_node)
        m.last_node = ext[-1]
        m.host_nodes.extend(ext)
        pages = sum(n.num_pages for n in ext)
        l3 = self.hits.take(ext, self.observer)
        m.host_len += pages
        m.l3_len += l3
        ps = s.layout.page_size
        s.metrics.miss_tokens -= pages * ps
        s.metrics.l2_hit_tokens += (pages - l3) * ps
        s.metrics.l2_hit_pages += pages - l3
        self.metrics.l3_hit_tokens += l3 * ps
        self.metrics.l3_hit_pages += l3

    def _walk(self, tokens: np.ndarray) -> tuple[list[Node], tuple[Node, int] | None]:
        """The tree's nodes wholly inside `tokens` (whole pages) from the root,
        and the node where the walk stopped inside (with how many of its pages
        match), if any. Unlike `RadixTree.match` it never splits: other
        requests' match results keep their nodes. O(tokens) in numpy."""
        ps = self.s.layout.page_size
        pages = len(tokens) // ps
        path: list[Node] = []
        node, i = self.s.tree.root, 0
        while i < pages:
            child = node.children.get(tokens[i * ps : (i + 1) * ps].tobytes())
            if child is None:
                break
            k = min(child.num_pages, pages - i) * ps
            diff = np.flatnonzero(child.tokens[:k] != tokens[i * ps : i * ps + k])
            n = int(diff[0]) // ps if len(diff) else k // ps
            if n < child.num_pages:
                return path, (child, n)
            path.append(child)
            node, i = child, i + n
        return path, None

    # ---- write-back ----------------------------------------------------------------------------

    def on_committed(self, nodes: Sequence[Node]) -> None:
        """Backups committed these nodes' host copies: queue their write-back."""
        if self.config.write_min_hits > 0:
            return  # written when hit often enough (`_write_on_hits`)
        for node in nodes:
            self._enqueue(node)

    def _write_on_hits(self, m: MatchResult) -> None:
        """Under `write_min_hits`, queue committed nodes of this match that just reached it."""
        k = self.config.write_min_hits
        if k == 0:
            return
        node: Node | None = m.last_node
        while node is not None and node is not self.s.tree.root:
            if node.hit_count == k and node.host_state is HostState.COMMITTED:
                self._enqueue(node)
            node = node.parent

    def _enqueue(self, node: Node) -> None:
        s, g = self.s, self.scheme.group
        a, b = node.first_position, node.end_position
        k_lo, k_hi = (a + g) // g - 1, b // g  # groups whose last page lies in [a, b)
        if k_lo >= k_hi:
            return
        runs = self._host_run(node, k_lo * g)
        if runs is None:  # a group's head lacks a committed host copy: write the groups that do not need it
            k_lo = (a + g - 1) // g
            if k_lo >= k_hi:
                return
            runs = self._host_run(node, k_lo * g)
            assert runs is not None
        held = runs[: (k_hi - k_lo) * g]
        if self.queued_pages + len(held) > self.queue_limit:
            self.metrics.l3_put_skipped_full += len(held)
            return
        hashes = PositionHashes(a, self._node_hashes(node))
        objects = self.scheme.objects(hashes, range(k_lo, k_hi))
        physical = [self._physical(held, k_lo * g, o) for o in objects]
        job = WriteJob(held, objects, physical, hold_s=self.config.hold_after_unsafe_failure_s)
        self.held[held] += 1
        self.queued_pages += len(held)
        if objects and self.client.up:
            job.future = self.client.submit_put(objects, physical)
            if self.events is not None:
                self.events.queued(job, node, k_lo * g, k_hi * g)
            self.metrics.l3_put_jobs += 1
            if self.observer is not None:
                self.observer.on_l3_put_started([o.key for o in objects])
        elif objects:
            self.metrics.l3_put_skipped_down += sum(len(o.positions) for o in objects)
        self.writes.append(job)

    def _host_run(self, node: Node, lo: int) -> np.ndarray | None:
        """Logical L2 pages of positions [lo, node.end) from the node and its
        ancestors' committed host copies; None if one lacks it."""
        parts: list[np.ndarray] = []
        n: Node | None = node
        while n is not None and n is not self.s.tree.root and n.end_position > lo:
            if n.host_state is not HostState.COMMITTED or n.host_pages is None:
                return None
            parts.append(n.host_pages[max(0, lo - n.first_position) :])
            n = n.parent
        parts.reverse()
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def _retire(self, job: WriteJob) -> None:
        s = self.s
        job.transition(WriteState.RETIRED)
        self.held[job.held] -= 1
        self.queued_pages -= len(job.held)
        done = job.held[(self.held[job.held] == 0) & self.deferred[job.held]]
        if len(done):
            self.deferred[done] = False
            s.free_host_pages(done)
        if job.future is None:
            return
        if job.yielded:
            self.metrics.l3_put_yielded += sum(len(o.positions) for o in job.objects)
            self._observe_put(job, [])
            return
        if job.error is not None:
            self.client.failed(job.error)
            if job.quarantined:
                self.metrics.l3_quarantined_ops += 1
            logger.warning("rank %d: write-back job %d failed: %s", s.rank, job.id, job.error)
            self._observe_put(job, [])
            return
        out: PutOutcome = job.future.result()
        self.metrics.l3_put_keys += out.keys_put
        self.metrics.l3_put_bytes += out.bytes_put
        self.metrics.l3_put_skipped_present += out.skipped_present
        self.metrics.l3_put_failed_keys += len(out.errors)
        for err in out.errors[:1]:
            self.client.failed(err)
            logger.warning("rank %d: write-back job %d: %d of its keys not stored, e.g. %s",
                           s.rank, job.id, len(out.errors), err)  # fmt: skip
        self._observe_put(job, out.put_keys, clean=not out.errors)

    def _observe_put(self, job: WriteJob, stored: list[str], clean: bool = False) -> None:
        if self.events is not None:
            self.events.retired(job, clean)
        if self.observer is not None:
            self.observer.on_l3_put([o.key for o in job.objects], stored)

    def yield_queued_puts(self) -> bool:
        """See `L3Hooks.yield_queued_puts`. Cancels, on this rank, the puts of
        jobs holding an evicted page that the put worker has not taken yet; a
        job retires at the next agreed poll once no rank's put of it runs (a
        rank whose put had started keeps every rank's pages until it ends).
        O(jobs + held pages)."""
        holding = False
        for job in self.writes:
            if not self.deferred[job.held].any():
                continue
            holding = True
            if job.future is not None and not job.yielded and job.future.cancel():
                job.yielded = True
        return holding

    def on_evict_l2(self, pages: np.ndarray) -> np.ndarray:
        """L2 evicts `pages`: return those free now; held ones wait for their job.
        Their copies leave the tree: none is fresh any more."""
        self.hits.forget(pages)
        mask = self.held[pages] > 0
        if not mask.any():
            return pages
        self.deferred[pages[mask]] = True
        self.metrics.l3_deferred_frees += int(mask.sum())
        return pages[~mask]

    # ---- hashes ------------------------------------------------------------------------------

    def _end_hash_of(self, node: Node) -> bytes:
        """Chain hash of `node`'s last page (b"" for the root). Memoised per node."""
        chain: list[Node] = []
        n: Node | None = node
        h = b""
        while n is not None and n is not self.s.tree.root:
            memo = self._end_hash.get(n.id)
            if memo is not None and memo[0] == n.end_position:
                h = memo[1]
                break
            chain.append(n)
            n = n.parent
        if len(self._end_hash) > _HASH_MEMO_LIMIT:
            self._end_hash.clear()
        for n in reversed(chain):
            h = chain_hashes(n.tokens, self.s.layout.page_size, h)[-1]
            self._end_hash[n.id] = (n.end_position, h)
        return h

    def _node_hashes(self, node: Node) -> list[bytes]:
        parent = node.parent
        base = self._end_hash_of(parent) if parent is not None else b""
        hashes = chain_hashes(node.tokens, self.s.layout.page_size, base)
        self._end_hash[node.id] = (node.end_position, hashes[-1])
        return hashes

    def _request_hashes(self, m: MatchResult, lo: int, hi: int) -> PositionHashes:
        """Chain hashes of the request's positions [lo, hi), from the deepest
        node of its matched path that ends at or before `lo`."""
        anchor: Node = m.last_node
        while anchor is not self.s.tree.root and anchor.end_position > lo:
            anchor = anchor.parent  # type: ignore[assignment]
        base = anchor.end_position if anchor is not self.s.tree.root else 0
        h0 = self._end_hash_of(anchor) if anchor is not self.s.tree.root else b""
        ps = self.s.layout.page_size
        hashes = chain_hashes(m.tokens[base * ps : hi * ps], ps, h0)
        return PositionHashes(lo, hashes[lo - base :])

    # ---- introspection and teardown ----------------------------------------------------------

    def wait_inflight(self) -> None:
        """Wait for this rank's prefetch reads (each up to its deadline): `settle`."""
        for op in self.prefetches:
            self.wait_local(op)

    def owned_host_pages(self) -> list[np.ndarray]:
        """L2 pages outside the tree that the tier holds: prefetch reservations
        and evicted pages waiting for a write-back."""
        out = [op.host_pages for op in self.prefetches]
        out.append(np.flatnonzero(self.deferred))
        return out

    def check_invariants(self) -> None:
        held = np.zeros_like(self.held)
        for job in self.writes:
            assert job.active, f"write job {job.id} retired but listed"
            np.add.at(held, job.held, 1)
        assert np.array_equal(held, self.held), "L3 hold counts drifted from the active write jobs"
        assert self.queued_pages == sum(len(j.held) for j in self.writes), "L3 queue size drifted"
        assert not (self.deferred & (self.held == 0)).any(), "an evicted L2 page waits for no write job"
        for op in self.prefetches:
            assert op.active, f"prefetch {op.id} decided but listed"
            assert len(op.host_pages) == op.end - op.first_position
        self.hits.check_invariants()

    def stats(self) -> dict[str, object]:
        d = self.metrics.as_dict()
        d["l3_health"] = self.client.health.value
        d["l3_prefetches_in_flight"] = len(self.prefetches)
        d["l3_write_jobs_in_flight"] = len(self.writes)
        d["l3_held_pages"] = int((self.held > 0).sum())
        d["l3_fingerprint"] = self.scheme.fingerprint
        requests = max(1, self.s.metrics.requests)
        keys = self.metrics.l3_lookup_keys + self.metrics.l3_get_keys + self.metrics.l3_put_keys
        d["l3_keys_per_request"] = round(keys / requests, 3)
        return d

    def close(self) -> bool:
        """Stop the workers (see `L3Client.close`); False: the L2 arenas must stay mapped."""
        return self.client.close()
