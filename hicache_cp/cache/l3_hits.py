"""L3Hits: which L2 copies came from L3, so that their first use counts as an L3 hit.

An L3 prefetch commits the pages it fetched as ordinary L2 copies. A request
that uses them (at once, when it waited for its prefetch, or later, when the
prefetch did not wait or served another request's queue slot) would count
them as L2 hits; the tier marks them `fresh` when they land and moves the
first use of each from the L2 to the L3 hits. A load that then aborts or is
dropped uncounts them as the cache uncounts any hit it could not serve.

    mark(op, attached)    a prefetch committed: its attached pages are fresh
    claim(m)              a match uses host copies: fresh ones are L3 hits, once
    note_load(m, load)    the match's load ran (or could not start)
    forget(pages)         L2 evicts pages: their copies are no longer fresh

Every decision reads replicated state only (the tree, the match), so all CP
ranks count alike; the object keys behind a fresh page are this rank's share.

Runs in: the cache's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from hicache_cp.cache.state import CacheState
from hicache_cp.l3.metrics import L3Metrics
from hicache_cp.l3.ops import PrefetchOp
from hicache_cp.match import MatchResult
from hicache_cp.ops import LoadOp, LoadState
from hicache_cp.radix import HostState, Node

logger = logging.getLogger(__name__)


class HitObserver(Protocol):
    """Hears which of this rank's objects served an L3 hit (`Tier3`'s observer)."""

    def on_l3_hit(self, page_keys: list[tuple[str, ...]]) -> None: ...


class L3Hits:
    """The fresh marks of one cache rank's L2 pages; see the module docstring."""

    def __init__(self, state: CacheState, metrics: L3Metrics, capacity: int) -> None:
        self.s = state
        self.metrics = metrics
        #: Logical L2 page -> it holds a committed copy an L3 prefetch fetched that
        #: no match used yet. Replicated on every rank.
        self.fresh = np.zeros(capacity + 1, dtype=bool)
        #: Per fresh page, this rank's object keys holding it (filled only for an
        #: observer, told when the page is claimed).
        self.fresh_keys = np.full(capacity + 1, None, dtype=object)
        self._loads: list[tuple[LoadOp, int]] = []  # loads carrying L3-hit pages

    def mark(self, op: PrefetchOp, attached: np.ndarray, observer: HitObserver | None) -> None:
        """The pages of `op` that joined the tree (`attached`, a mask) are fresh."""
        self.fresh[op.host_pages[attached]] = True
        if observer is None:
            return
        keys: dict[int, list[str]] = {}
        for obj in op.objects:
            for p in obj.positions.tolist():
                keys.setdefault(p, []).append(obj.key)
        for i in np.flatnonzero(attached).tolist():
            mine = keys.get(op.first_position + i)  # None: a CP rank that owns no page here
            self.fresh_keys[op.host_pages[i]] = tuple(mine) if mine else None

    def claim(self, m: MatchResult, observer: HitObserver | None) -> None:
        """`match_prefix(m)` counted its host continuation as L2 hits: move the
        pages whose copies an L3 prefetch landed and nobody used yet to the L3
        hits (`m.l3_len`, so a dropped or aborted load uncounts them like a
        waiting prefetch's). Replicated: the same on every rank. O(host pages)."""
        n = self.take(m.host_nodes, observer)
        if not n:
            return
        ps = self.s.layout.page_size
        m.l3_len += n
        self.s.metrics.l2_hit_tokens -= n * ps
        self.s.metrics.l2_hit_pages -= n
        self.metrics.l3_hit_tokens += n * ps
        self.metrics.l3_hit_pages += n
        logger.debug("rank %d: %d pages of a match were landed by L3 prefetches: L3 hits", self.s.rank, n)

    def take(self, nodes: Sequence[Node], observer: HitObserver | None) -> int:
        """Clear the fresh pages among `nodes`' host copies; return how many there were
        (the caller counts them as L3 hits). O(pages) in numpy."""
        if not nodes:
            return 0
        pages = np.concatenate([n.host_pages for n in nodes])  # type: ignore[misc]
        hit = pages[self.fresh[pages]]
        if not len(hit):
            return 0
        self.fresh[hit] = False
        if observer is not None:
            keys = [k for k in self.fresh_keys[hit].tolist() if k]  # a CP rank's share: pages with objects here
            self.fresh_keys[hit] = None
            if keys:
                observer.on_l3_hit(keys)
        return len(hit)

    def note_load(self, m: MatchResult, load: LoadOp | None) -> None:
        """`load_back(m)` ran: keep the L3 share of its hits honest if it is dropped or aborts."""
        if not m.l3_len:
            return
        if load is None and not m.host_nodes:  # L1 could not take the host continuation: all misses now
            self._uncount(m.l3_len)
            m.l3_len = 0
        elif load is not None:
            self._loads.append((load, m.l3_len))

    def correct_aborted_loads(self) -> None:
        """After a poll's decisions: the L3 hits of loads that aborted are misses."""
        keep = []
        for load, pages in self._loads:
            if load.state is LoadState.ABORTED:
                self._uncount(pages)
            elif load.active:
                keep.append((load, pages))
        self._loads = keep

    def _uncount(self, pages: int) -> None:
        """Lifecycle moved these pages' hits from L2 to misses; they were L3 hits."""
        ps = self.s.layout.page_size
        self.s.metrics.l2_hit_tokens += pages * ps
        self.metrics.l3_hit_tokens -= pages * ps
        self.metrics.l3_hit_pages -= pages

    def forget(self, pages: np.ndarray) -> None:
        """L2 evicts `pages`: their copies leave the tree, none is fresh any more."""
        self.fresh[pages] = False
        self.fresh_keys[pages] = None

    def check_invariants(self) -> None:
        committed = np.zeros_like(self.fresh)
        for node in self.s.tree.nodes():
            if node.host_state is HostState.COMMITTED:
                committed[node.host_pages] = True
        stray = np.flatnonzero(self.fresh & ~committed)
        assert not len(stray), f"L2 pages {stray[:8].tolist()} are fresh from L3 but hold no committed copy in the tree"
