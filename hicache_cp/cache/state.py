"""What every part of the cache manager shares: pools, tree, ops in flight, counters.

One `CacheState` per `HiCache`. The components (`prefix`, `lifecycle`,
`eviction`) each hold it and change it only through their own methods; the
facade (`hicache_cp.cache.hicache`) builds them and is the only public entry.
`check_invariants` asserts every cross-structure invariant of the whole
state (docs/architecture.md lists them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hicache_cp.config import Config
from hicache_cp.cp.agreement import Agreement, Vote
from hicache_cp.events import EventLog, Medium, Removal
from hicache_cp.io.base import CopyEngine
from hicache_cp.layout import KVLayout, Part
from hicache_cp.metrics import CacheMetrics
from hicache_cp.ops import BackupOp, LoadOp
from hicache_cp.policy import EvictionPolicy
from hicache_cp.pools import DevicePool, HostPool
from hicache_cp.radix import HostState, Node, RadixTree


class L3Hooks(Protocol):
    """What the other components call on the L3 tier (`hicache_cp.cache.tier3.Tier3`)."""

    @property
    def busy(self) -> bool:
        """Prefetches or write-backs still active (replicated: the same on every rank)."""

    def poll_ops(self) -> Sequence[Any]:
        """Its ops that vote in this poll, after the backups and loads."""

    def decide(self, decisions: Sequence[tuple[Any, Vote]]) -> None:
        """Apply the agreed votes of those ops."""

    def wait_inflight(self) -> None:
        """`settle`: wait for this rank's prefetch reads (bounded by their deadlines)."""

    def on_committed(self, nodes: Sequence[Node]) -> None:
        """A backup committed these nodes' host copies."""

    def on_evict_l2(self, pages: np.ndarray) -> np.ndarray:
        """L2 evicts these pages: return those that may be freed now."""

    def yield_queued_puts(self) -> bool:
        """A backup found no room in L2: give up the write-backs not yet started
        that hold evicted pages. Whether any job holds one (replicated: then every
        rank polls, and those jobs retire once no rank's put of them runs)."""

    def owned_host_pages(self) -> list[np.ndarray]:
        """L2 pages outside the tree that the tier holds."""

    def check_invariants(self) -> None: ...


class NodeHooks(Protocol):
    """What the other components call on the node tier (`hicache_cp.cache.node_tier.NodeTier`)."""

    @property
    def private_copy(self) -> bool:
        """Whether this rank's copy is its own (freed pages may be poisoned), not the node's."""

    def share(self, first_position: int, num_pages: int) -> tuple[int, int] | None:
        """`[lo, hi)` of a backup's pages this rank copies; None: what it owns, as without the tier."""

    def on_committed(self, nodes: Sequence[Node]) -> None:
        """A backup committed these nodes' host copies (the journal records them)."""

    def on_free(self, pages: np.ndarray, failed: bool = False) -> None:
        """These pages leave L2 (`failed`: dropped after a failed check), before the
        allocator may hand them out again."""

    def first_use(self, pages: np.ndarray) -> np.ndarray:
        """Which of a load's logical `pages` were adopted and never checked (bool, aligned)."""

    def on_loaded(self, pages: np.ndarray) -> None:
        """A load of these pages was agreed done (each passed its check)."""

    def check_invariants(self, kept: np.ndarray) -> None:
        """`kept`: the L2 pages of committed copies and those the L3 tier holds."""


@dataclass(eq=False)
class CacheState:
    config: Config
    layout: KVLayout
    rank: int
    cp_size: int
    device_pool: DevicePool
    host_pool: HostPool
    engine: CopyEngine
    agreement: Agreement
    policy: EvictionPolicy
    tree: RadixTree
    metrics: CacheMetrics = field(default_factory=CacheMetrics)
    clock: int = 0  # one tick per match_prefix: the policies' notion of time
    backups: list[BackupOp] = field(default_factory=list)  # active, creation order (the agreement's order)
    loads: list[LoadOp] = field(default_factory=list)  # active, creation order
    loose_device_pages: int = 0  # handed out by alloc_device, not yet in the tree
    all_parts: frozenset[Part] = frozenset()
    l3: L3Hooks | None = None  # the L3 tier, when configured (cache.tier3)
    events: EventLog | None = None  # KV cache events for routers, when asked for (hicache_cp.events)
    #: L2 pages of copies dropped after a failed check, freed once no active load reads them
    #: (`drop_host_copy` with `Removal.INTEGRITY`, `release_quarantine`).
    quarantine: list[np.ndarray] = field(default_factory=list)
    node: NodeHooks | None = None  # the node tier, when configured (cache.node_tier)

    def __post_init__(self) -> None:
        self.all_parts = frozenset(p.part for p in self.layout.parts)

    def free_device_pages(self, pages: np.ndarray) -> None:
        """Give L1 pages back to the allocator. With debug checks on a host-memory pool
        they are poisoned first, so that reading a page after its free shows in the
        byte checks instead of passing on the bytes it still held."""
        if self.config.debug_checks and not self.device_pool.is_cuda:
            self.device_pool.poison(pages)
        self.device_pool.allocator.free(pages)

    def forget_host_pages(self, pages: np.ndarray, failed: bool = False) -> None:
        """`pages` hold no copy any more: the node tier's journal forgets them (it must
        not name a page that may be rewritten; `failed`: after a failed check) and
        their identity tags are cleared, so a stale reference that loads one fails
        its check. O(pages)."""
        if self.node is not None:
            self.node.on_free(pages, failed)
        self.host_pool.tags[pages] = 0

    def free_host_pages(self, pages: np.ndarray, *, forgotten: bool = False) -> None:
        """`free_device_pages` for L2, after `forget_host_pages` (unless `forgotten`
        already). A copy the node's ranks share is not poisoned (another rank may be
        writing the page's next content already)."""
        if not forgotten:
            self.forget_host_pages(pages)
        if self.config.debug_checks and (self.node is None or self.node.private_copy):
            self.host_pool.poison(pages)
        self.host_pool.allocator.free(pages)

    def commit_host_copy(self, node: Node, host_pages: np.ndarray | None = None) -> None:
        """`node`'s host copy (its pages, or `host_pages`) holds every part on every
        rank: it becomes visible to `match_prefix` and is announced (HOST stored).
        The one place an L2 copy turns visible."""
        if host_pages is not None:
            node.host_pages = host_pages
        node.host_state = HostState.COMMITTED
        node.host_parts = self.all_parts
        node.backup = None
        self.tree.refresh_family(node)
        if self.events is not None:
            self.events.stored(Medium.HOST, node)

    def drop_host_copy(self, node: Node, reason: Removal, others: np.ndarray | None = None) -> None:
        """The one place a committed L2 copy is removed (eviction, `l2_exclusive`, a
        failed integrity check): the node forgets it, it is announced (HOST removed),
        the node tier's journal forgets its pages, and they are freed (those an L3
        write-back still reads once it is done). `Removal.INTEGRITY` (a failed check,
        agreed on every rank: `Evictor.drop_host_copy`) quarantines them instead,
        freed once no active load reads them; `others` are pages the node named that
        another copy holds (a stale copy's): left alone. The caller counts it and
        prunes the node if it may now hold nothing (`RadixTree.prune`)."""
        pages = node.host_pages
        assert pages is not None and node.host_state is HostState.COMMITTED, f"{node}: no committed host copy to drop"
        if self.events is not None:
            self.events.removed(Medium.HOST, node, reason)
        node.host_pages = None
        node.host_state = HostState.NONE
        node.host_parts = frozenset()
        if others is not None:
            pages = pages[~np.isin(pages, others)]
        failed = reason is Removal.INTEGRITY
        self.forget_host_pages(pages, failed)
        if self.l3 is not None:  # pages an L3 write-back still reads are freed when it is done
            pages = self.l3.on_evict_l2(pages)
        if failed:
            self.quarantine.append(pages)
            self.release_quarantine()
        else:
            self.free_host_pages(pages, forgotten=True)
        self.tree.refresh_family(node)

    def release_quarantine(self) -> None:
        """Free dropped copies' pages that no active load reads any more (their journal
        entries and tags went at the drop). O(dropped + loading pages)."""
        if not self.quarantine:
            return
        reading = [op.host_pages for op in self.loads if op.active]
        busy = np.concatenate(reading) if reading else np.empty(0, np.int64)
        keep: list[np.ndarray] = []
        for pages in self.quarantine:
            if len(busy) and np.isin(pages, busy).any():
                keep.append(pages)
            elif len(pages):
                self.free_host_pages(pages, forgotten=True)
        self.quarantine = keep

    def device_changed(self, node: Node, stored: bool) -> None:
        """`node` got L1 pages (`stored`) or lost them: announced (DEVICE) when the
        cache owns L1 and a log is attached."""
        if self.events is not None:
            if stored:
                self.events.stored(Medium.DEVICE, node)
            else:
                self.events.removed(Medium.DEVICE, node, Removal.EVICTED)

    def debug_check(self) -> None:
        """`check_invariants` after an operation, when `debug_checks` asks for it."""
        if self.config.debug_checks:
            self.check_invariants()

    def check_invariants(self) -> None:
        """Assert every cross-structure invariant (O(tree size))."""
        self.tree.check_invariants()
        self.device_pool.allocator.check_invariants()
        self.host_pool.allocator.check_invariants()
        nodes = list(self.tree.nodes())
        dev = [n.device_pages for n in nodes if n.device_pages is not None]
        dev_all = np.concatenate(dev) if dev else np.empty(0, np.int64)
        assert len(np.unique(dev_all)) == len(dev_all), "an L1 page is owned by two nodes"
        assert self.device_pool.allocator.used_pages == len(dev_all) + self.loose_device_pages, (
            f"L1 leak: allocator uses {self.device_pool.allocator.used_pages}, tree holds {len(dev_all)}, "
            f"requests hold {self.loose_device_pages}"
        )
        host = [n.host_pages for n in nodes if n.host_pages is not None]
        host += [op.host_pages for op in self.backups if not op.nodes]
        host += [op.spare_host_pages for op in self.backups if op.nodes]  # trimmed at insert, freed at the decision
        host += self.quarantine  # dropped after a failed check, freed once no load reads them
        if self.l3 is not None:
            self.l3.check_invariants()
            host += self.l3.owned_host_pages()  # prefetch reservations, evictions waiting for a put
        host_all = np.concatenate(host) if host else np.empty(0, np.int64)
        assert len(np.unique(host_all)) == len(host_all), "an L2 page is owned twice"
        if self.node is not None:  # L2 pages with content: committed copies, pages the L3 tier holds
            kept = [n.host_pages for n in nodes if n.host_state is HostState.COMMITTED]
            kept += self.l3.owned_host_pages() if self.l3 is not None else []
            self.node.check_invariants(np.concatenate(kept) if kept else np.empty(0, np.int64))
        assert self.host_pool.allocator.used_pages == len(host_all), (
            f"L2 leak: allocator uses {self.host_pool.allocator.used_pages}, tree and reservations hold {len(host_all)}"
        )
        for n in nodes:
            if n.host_state is HostState.COMMITTED:
                assert n.host_parts == self.all_parts, f"{n}: committed without every part"
            if n.backup is not None:
                assert n.backup in self.backups and n.backup.active, f"{n}: backup not tracked"  # type: ignore[operator]
            if n.load is not None:
                assert n.load in self.loads, f"{n}: load not tracked"  # type: ignore[operator]
        for op in self.backups:
            for n in op.nodes:
                assert n.backup is op and n.host_state is HostState.PENDING, f"backup {op.id}: {n} not pending on it"
            if op.nodes:  # its nodes' runs and its spare pages are its reservation, each page once
                held = sum(n.num_pages for n in op.nodes) + len(op.spare_host_pages)
                assert held == op.num_pages, (
                    f"rank {self.rank}: backup {op.id}: nodes and spare pages hold {held} of its {op.num_pages} host pages"
                )
            else:
                assert not len(op.spare_host_pages), f"rank {self.rank}: backup {op.id}: spare pages but no node"
