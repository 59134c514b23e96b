"""Reuse-protected LRU: content seen twice outlives content seen once.

Predicts that a prefix accessed at least twice will be accessed again
sooner than one seen only once (a one-off document), counting accesses
across evictions with a ghost table of page prefix hashes; and that among
first-timers, a class of new pages whose pages were reused more often in
the recent past than fresh prompts' (a chat turn extending a cached prefix,
which the next turn extends again) is worth protecting too. Within either
group the least recently used goes first. Segmented LRU with a ghost
history is the idea behind 2Q, ARC and S3-FIFO; the learned admission of
first-timer classes is this policy's own.

L2 order (`key_in(node, "l2")`): `last_access + W` for a protected node,
`last_access` for a probationary one, so a protected node outlives
probationary ones up to W ticks older. W = `PROTECT` x the L2 turnover (the
running mean age at which L2 evicts probationary nodes), so protection
scales with the cache and a once-hot prefix still ages out; W is unbounded
until L2 first evicts. A node is protected when it was hit while cached
(`Node.hit_count`) or when `Node.reuse_hint` (set at insert) says so: the
ghost table remembers its pages from before, or its class is protected.
L1 order is plain LRU: every L1 node also has its L2 copy under
write-through, so L1 order only moves hits between the tiers (and under
`l2_exclusive` an L1 eviction moves the node to L2, where this order applies).

Classes of first-timer nodes (no ghost history), learned online: FRESH (the
node starts the prompt: nothing of it was cached) and EXTENSION (it
continues a cached prefix). Each class counts the pages it admitted and how
many of them were accessed again (the ghost table tags each page with its
class and credits the class on the page's second access), both decayed by
`CLASS_DECAY` per request. EXTENSION pages are protected while their reuse
rate is above FRESH pages'. On the public synthetic trace (documents
re-read whole) extensions are rarely reused and stay probationary; on the
embedded multi-turn workload they are the next turn's prefix and are
protected.

Costs per request: two prefix hashings of its pages (match, and insert of
its missed pages) and a few vectorised passes over the ghost table, about
70 us for 30 pages and 160 us for 500 on one core of the CI machine; a key
is about 0.5 us. Memory: `GHOST_FACTOR` slots per page of L1 + L2 at 13
bytes a slot, at most `GHOST_MAX_SLOTS`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hicache_cp.keys import prefix_hashes
from hicache_cp.policy.base import EvictionPolicy, register_policy
from hicache_cp.policy.ghost import GhostTable
from hicache_cp.radix import Node

FRESH, EXTENSION = 0, 1  # first-timer classes; ghost tag = class + 1


@register_policy("reuse_lru")
class ReuseLruPolicy(EvictionPolicy):
    """See the module docstring. Tuned on the public synthetic trace and the
    embedded workload at L2 = 5-50% of the footprint (bench/results/policy-sweep.json)."""

    PROTECT = 16.0  # protection window W, in L2 turnovers
    TURNOVER_DECAY = 0.99  # EWMA weight of the past, per evicted probationary node
    CLASS_DECAY = 0.999  # per request, on the class counters
    GHOST_FACTOR = 4  # ghost slots per page of L1 + L2
    GHOST_MAX_SLOTS = 1 << 22  # 52 MiB

    def __init__(self) -> None:
        self.page_size = 0  # 0 until bound: hooks do nothing, keys are plain LRU
        self.ghost = GhostTable(2)
        self.turnover: float | None = None  # ticks; None until L2 first evicts a probationary node
        self.admitted = np.zeros(2)  # first-timer pages admitted, per class (decayed)
        self.reused = np.zeros(2)  # of those, accessed again (decayed)

    def bind(self, *, page_size: int, l1_pages: int, l2_pages: int) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.page_size = page_size
        want = max(2, self.GHOST_FACTOR * (l1_pages + l2_pages))
        self.ghost = GhostTable(min(1 << (want - 1).bit_length(), self.GHOST_MAX_SLOTS))

    # ---- order -------------------------------------------------------------------------

    @property
    def window(self) -> float:
        """Ticks a protected node outlives probationary ones (inf before any L2 eviction)."""
        return math.inf if self.turnover is None else self.PROTECT * self.turnover

    @staticmethod
    def protected(node: Node) -> bool:
        return node.hit_count > 0 or node.reuse_hint > 0

    def key(self, node: Node) -> float:
        if self.protected(node):
            return node.last_access + min(self.window, 1e18)
        return float(node.last_access)

    def key_in(self, node: Node, tier: str) -> float:
        return float(node.last_access) if tier == "l1" else self.key(node)

    def extension_protected(self) -> bool:
        """Are EXTENSION first-timers reused more often than FRESH ones lately?"""
        rate = (self.reused + 1.0) / (self.admitted + 2.0)
        return bool(rate[EXTENSION] > rate[FRESH])

    # ---- hooks -------------------------------------------------------------------------

    def on_match(self, pages: np.ndarray, used: Sequence[Node], clock: int) -> None:
        if not self.page_size:
            return
        before, tags = self.ghost.touch(prefix_hashes(pages, self.page_size))
        self.admitted *= self.CLASS_DECAY
        self.reused *= self.CLASS_DECAY
        second = tags[(before == 1) & (tags > 0)]  # first-timer pages back for the first time
        if len(second):
            self.reused += np.bincount(second, minlength=3)[1:3]

    def on_insert(self, pages: np.ndarray, node: Node, clock: int) -> None:
        if not self.page_size:
            return
        hashes = prefix_hashes(pages, self.page_size)[node.first_position : node.end_position]
        seen = int(self.ghost.counts(hashes).max()) - 1 if len(hashes) else 0  # minus this request's access
        if seen > 0:
            node.reuse_hint = seen
            return
        cls = EXTENSION if node.first_position > 0 else FRESH
        self.admitted[cls] += node.num_pages
        self.ghost.tag(hashes, cls + 1)
        node.reuse_hint = int(cls == EXTENSION and self.extension_protected())

    def on_evict(self, node: Node, tier: str, clock: int) -> None:
        if tier != "l2" or self.protected(node):
            return
        age = float(clock - node.last_access)
        d = self.TURNOVER_DECAY
        self.turnover = age if self.turnover is None else d * self.turnover + (1 - d) * age
