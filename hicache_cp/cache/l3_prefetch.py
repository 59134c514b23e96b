"""L3Prefetcher: the prefetch flow of the L3 tier (`cache/tier3.py`).

    start(m, wait)    after the L1 prefix and the L2 continuation: look up the
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
    decide(op, vote)  the agreed vote of one prefetch (`PrefetchOp`: FETCHING ->
                      COMMITTED, or FAILING -> ABORTED).

Starting a prefetch reads replicated state only, and its length is agreed;
what a rank's get did reaches the other ranks only through the op's vote.

Runs in: the cache's thread; the gets run on `L3Client`'s workers.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from hicache_cp.cache.eviction import Evictor
from hicache_cp.cache.l3_hashes import ChainHashes
from hicache_cp.cache.l3_hits import HitObserver, L3Hits
from hicache_cp.cache.state import CacheState
from hicache_cp.cache.store_events import StoreEvents
from hicache_cp.checksum import Verify
from hicache_cp.cp.agreement import Vote
from hicache_cp.events import Medium
from hicache_cp.keys import prefix_hashes
from hicache_cp.l3.client import L3Client
from hicache_cp.l3.config import L3Config
from hicache_cp.l3.keys import L3Object
from hicache_cp.l3.ops import PrefetchOp, PrefetchState
from hicache_cp.l3.store import L3Error, L3Timeout
from hicache_cp.match import MatchResult
from hicache_cp.radix import HostState, Node

logger = logging.getLogger(__name__)


class L3Prefetcher:
    """The L3 prefetches of one cache rank; see the module docstring."""

    def __init__(self, state: CacheState, evictor: Evictor, client: L3Client, config: L3Config, hits: L3Hits,
                 hashes: ChainHashes) -> None:  # fmt: skip
        self.s = state
        self.evictor = evictor
        self.client = client
        self.scheme = client.scheme
        self.config = config
        self.metrics = client.metrics
        self.hits = hits
        self.hashes = hashes
        self.observer: HitObserver | None = None
        self.events: StoreEvents | None = None  # STORE events, when the cache has an event log
        self.prefetches: list[PrefetchOp] = []  # active, creation order (the agreement's order)

    def start(self, m: MatchResult, wait: bool) -> PrefetchOp | None:
        """Start fetching the L3 continuation of `m`; see `HiCache.prefetch`.

        Costs one lookup (bounded by `lookup_timeout_s`) and, when anything
        could be fetched, one MIN collective (every rank calls this at the
        same step). Returns None when there is nothing to fetch, the store
        is down, L2 cannot make room, or (not waiting) an active prefetch
        already fetches from `m`'s end."""
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
        hashes = self.hashes.request(m, s0, groups.stop * g)
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
            op.future = self.client.submit_get(mine, [self.scheme.physical(host, s0, o) for o in mine])
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

    def wait_inflight(self) -> None:
        """Wait for this rank's prefetch reads (each up to its deadline): `settle`."""
        for op in self.prefetches:
            self.wait_local(op)

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

    # ---- decisions (from Lifecycle.poll, through Tier3.decide) ---------------------------------

    def decide(self, op: PrefetchOp, vote: Vote) -> None:
        """Apply the agreed vote of `op`: commit, start failing, or abort."""
        if vote.ok and vote.settled:
            self._commit(op)
        elif not vote.ok:
            if op.state is PrefetchState.FETCHING:
                op.transition(PrefetchState.FAILING)
                self._count_failure(op)
            if vote.settled:
                self._abort(op)

    def drop_decided(self) -> None:
        """Forget the prefetches `decide` committed or aborted (after a poll's decisions)."""
        self.prefetches = [op for op in self.prefetches if op.active]

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

    def owned_host_pages(self) -> list[np.ndarray]:
        """The L2 reservations of the active prefetches (outside the tree)."""
        return [op.host_pages for op in self.prefetches]

    def check_invariants(self) -> None:
        for op in self.prefetches:
            assert op.active, f"prefetch {op.id} decided but listed"
            assert len(op.host_pages) == op.end - op.first_position
