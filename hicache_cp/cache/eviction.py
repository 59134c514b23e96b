"""Space in both tiers: allocation with eviction, and the free-room targets.

L1 pages are handed to requests (`alloc_device`) and L2 pages to backups
(`reserve_host`); both evict first when the tier is under its free-room
target. Eviction goes down to the target, not only the deficit (docs/invariants.md
rule 5): evicting just the deficit keeps the cache at the cliff and repeats
evict/allocate on every request. Victims are the tree's evictable leaves in
the policy's order; a node whose eviction empties its parent makes the
parent a candidate in the same pass.

Under `write_back`, an L1 victim without a host copy is backed up instead
(the lifecycle's all-layer backup) and leaves L1 once that commits. A pass
counts the pages of such backups as freed, so it backs up only what the
target needs; when the request's pages still do not fit, it waits for those
copies (`settle_backups`: the lifecycle's settle, an agreed poll, taken at
the same step on every rank since the decision reads replicated state only)
and evicts again.

Under `l2_exclusive`, a node loaded from L2 gives up its L2 copy once nobody
holds it (`drop_loaded_copies`, run before each eviction pass and by
`ensure_free`): a request holding a node may still read its L2 pages (a
PD transfer sends committed pages from L2), so a locked node keeps its copy.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable

import numpy as np

from hicache_cp.cache.state import CacheState
from hicache_cp.config import WritePolicy
from hicache_cp.events import Removal
from hicache_cp.radix import HostState, Node

logger = logging.getLogger(__name__)


class Evictor:
    """Allocates pages of both tiers, evicting by policy to the free-room targets."""

    def __init__(self, state: CacheState) -> None:
        self.s = state
        #: write_back: start a backup of an L1 victim that has no host copy;
        #: returns whether one started (set by the facade to the lifecycle's).
        self.backup_victim: Callable[[Node], bool] = lambda node: False
        #: write_back: wait for the copies in flight and decide them (the lifecycle's settle).
        self.settle_backups: Callable[[], None] = lambda: None
        #: decide what completed, non-blocking (the lifecycle's poll: agreed).
        self.poll: Callable[[], None] = lambda: None
        #: l2_exclusive: nodes loaded into L1 whose L2 copies go once they are unlocked (load order).
        self.loaded: list[Node] = []
        state.policy.bind(
            page_size=state.layout.page_size,
            l1_pages=state.device_pool.allocator.capacity,
            l2_pages=state.host_pool.allocator.capacity,
        )

    def alloc_device(self, n: int, first_position: int) -> np.ndarray | None:
        """L1 pages for request positions [first_position, first_position + n), or None."""
        s = self.s
        if not self.make_room("l1", n, first_position):
            s.metrics.l1_alloc_failures += 1
            logger.warning("rank %d: L1 cannot fit %d pages even after eviction", s.rank, n)
            return None
        pages = s.device_pool.allocator.alloc(n, first_position)
        assert pages is not None
        s.loose_device_pages += n
        return pages

    def free_device(self, pages: np.ndarray) -> None:
        self.s.free_device_pages(pages)
        self.s.loose_device_pages -= len(pages)

    def reserve_host(self, n: int, first_position: int) -> np.ndarray | None:
        """L2 pages for a backup, or None (counted as a skipped backup).

        With an L3 tier, evicted pages still held by write-backs whose puts have
        not started are taken from them first (one agreed poll): a backup of
        new pages beats a put of old ones."""
        s = self.s
        s.metrics.backup_pages_wanted += n
        fits = self.make_room("l2", n, first_position)
        if not fits and s.l3 is not None and s.l3.yield_queued_puts():
            # Write-backs hold evicted pages until their puts end; a put that has not
            # started gives them up rather than starve L2 of new copies.
            self.poll()  # agreed: the yielded jobs retire and free those pages
            fits = self.make_room("l2", n, first_position)
        if not fits:
            s.metrics.backups_skipped += 1
            s.metrics.backup_pages_skipped += n
            return None
        host = s.host_pool.allocator.alloc(n, first_position)
        assert host is not None
        return host

    def ensure_free(self) -> None:
        """Evict each tier back up to its free-room target when under it."""
        self.s.release_quarantine()
        self.drop_loaded_copies()
        self.make_room("l1", 0, 0)
        self.make_room("l2", 0, 0)

    def note_loaded(self, nodes: list[Node]) -> None:
        """`l2_exclusive`: these nodes' loads are done; their L2 copies are now duplicates."""
        self.loaded.extend(nodes)

    def drop_loaded_copies(self) -> None:
        """`l2_exclusive`: free the L2 copies of loaded nodes that L1 still holds
        and nobody holds (write_back backs them up again when L1 evicts them).
        Locked ones wait for a later call; the others leave the list. O(list)."""
        s = self.s
        keep: list[Node] = []
        for node in self.loaded:
            if not (node.on_device and node.host_visible and node.stale_load is None and node.load is None):
                continue  # left L1, lost its copy, or became stale: nothing to drop
            if node.lock_ref > 0:
                keep.append(node)
                continue
            s.drop_host_copy(node, Removal.EXCLUSIVE)
        self.loaded = keep

    def drop_host_copy(self, nodes: list[Node], pages: np.ndarray, reason: object, others: np.ndarray | None = None) -> int:
        """A restore check failed on L2 `pages` (logical): every node among `nodes`
        whose committed copy holds one of them loses that copy now, on every rank
        (the caller decided it with an agreed vote), so no match returns it again.

        The one place where a failed check takes a copy out of L2 (a load's check,
        the identity check of a match; an adopted copy's first use is a load): it goes
        through `CacheState.drop_host_copy(node, Removal.INTEGRITY)`, which announces
        it (HOST removed), makes the node tier's journal forget it (never adopted
        again) and clears its identity tags at once; its pages are freed once no
        active load reads them (`CacheState.release_quarantine`). `others` are pages the node
        named but another copy holds (a stale copy's): left alone. Returns the pages
        dropped. O(nodes + pages)."""
        s = self.s
        dropped = 0
        bad = set(np.asarray(pages, dtype=np.int64).tolist())
        for node in nodes:
            held = node.host_pages
            if node.host_state is not HostState.COMMITTED or held is None or not bad.intersection(held.tolist()):
                continue
            dropped += len(held)
            s.metrics.integrity_dropped_pages += node.num_pages
            logger.warning("rank %d: the L2 copy of %s (%d pages) is dropped after a failed check: %s",
                           s.rank, node, node.num_pages, reason)  # fmt: skip
            s.drop_host_copy(node, Removal.INTEGRITY, others)
            s.tree.prune(node)
        return dropped

    def make_room(self, tier: str, need: int, first_position: int) -> bool:
        """Evict until `tier` has `need` pages for these positions plus its
        free-room target free, or nothing more is evictable. Returns whether
        `need` pages fit now. O(k log k) over the k evictable leaves.

        Under `write_back`, while L1 victims are being backed up and `need`
        does not fit yet, waits for their copies (`settle_backups`) and
        evicts again, as long as a round frees pages."""
        fits = self._make_room(tier, need, first_position)
        # Each round evicts the victims whose backups committed; their parents
        # may be victims of the next round. A round that frees nothing (their
        # backups failed) ends it: the allocation fails rather than retrying.
        alloc = self.s.device_pool.allocator
        while not fits and tier == "l1" and self._victim_backup_pages():
            before = alloc.free_pages
            self.settle_backups()
            fits = self._make_room(tier, need, first_position)
            if alloc.free_pages == before:
                break
        return fits

    def _victim_backup_pages(self) -> int:
        """write_back: L1 pages whose all-layer backup is in flight (they leave
        L1 once it commits); 0 under other write policies."""
        s = self.s
        if s.config.write_policy is not WritePolicy.WRITE_BACK:
            return 0
        return sum(op.num_pages for op in s.backups if not op.layerwise and op.active and op.nodes)

    def _make_room(self, tier: str, need: int, first_position: int) -> bool:
        s = self.s
        if self.loaded:
            self.drop_loaded_copies()
        pool = s.device_pool if tier == "l1" else s.host_pool
        alloc = pool.allocator
        target = s.config.free_room_pages(tier, alloc.capacity)
        if alloc.free_pages >= target + need and alloc.fits(need, first_position):
            return True
        goal = min(target + need, alloc.capacity)
        leaves = s.tree.device_leaves if tier == "l1" else s.tree.host_leaves
        pending = self._victim_backup_pages() if tier == "l1" else 0  # freed once their backups commit
        heap = [(s.policy.key_in(n, tier), n.id, n) for n in leaves]
        heapq.heapify(heap)
        while heap and not (
            alloc.free_pages + pending >= goal and (pending or alloc.fits(need, first_position))
        ):
            _, _, node = heapq.heappop(heap)
            if node not in leaves:
                continue
            parent = self._evict_l1(node) if tier == "l1" else self._evict_l2(node)
            if parent is None:  # write_back: a backup started, the pages leave L1 at its commit
                pending += node.num_pages
            elif parent in leaves:
                heapq.heappush(heap, (s.policy.key_in(parent, tier), parent.id, parent))
        return alloc.fits(need, first_position)

    def _evict_l1(self, node: Node) -> Node | None:
        s = self.s
        stale = node.stale_load is not None  # garbage: dropped, never backed up
        if s.config.write_policy is WritePolicy.WRITE_BACK and node.host_state is HostState.NONE and not stale:
            if self.backup_victim(node):
                return None  # evictable once the backup commits
        pages = node.device_pages
        assert pages is not None
        s.device_changed(node, stored=False)
        node.device_pages = None
        node.stale_load = None
        s.free_device_pages(pages)
        s.metrics.evictions_l1 += len(pages)
        s.policy.on_evict(node, "l1", s.clock)
        s.tree.refresh_family(node)
        parent = node.parent
        s.tree.prune(node)
        return parent

    def _evict_l2(self, node: Node) -> Node | None:
        s = self.s
        s.metrics.evictions_l2 += node.num_pages
        s.policy.on_evict(node, "l2", s.clock)
        s.drop_host_copy(node, Removal.EVICTED)
        parent = node.parent
        s.tree.prune(node)
        return parent
