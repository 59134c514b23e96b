"""HiCache: the L1 + L2 cache manager a prefill server talks to.

One radix tree indexes both tiers; every page of it is one logical object of
all parts (target KV, target NSA state, draft KV, draft state). The protocol
of one request (runs in the prefill server's scheduler process, on every CP
rank with the same calls):

    m = cache.match_prefix(tokens)            # L1 prefix + committed L2 continuation;
                                              # locks the matched path
    load = cache.load_back(m)                 # L1 pages for the L2 part, H2D per layer
    new = cache.alloc_device(n, m.matched_pages)          # L1 pages for the miss
    bk = cache.reserve_backup(new, m.matched_pages)       # write-through: L2 reservation
    for layer in target layers:
        load.wait_layer(layer)                # the forward waits per layer
        ...compute layer, write KV of `new`...
        cache.on_layer_end(Model.TARGET, layer, [bk])     # D2H of that layer starts
                                              # (for this forward's reservations)
    for layer in draft layers: ...same with Model.DRAFT
    node = cache.insert(m, new, backup=bk)    # pages join the tree; host copy stays
                                              # invisible until committed
    cache.poll()                              # agreed acks -> commits / aborts
    cache.release(node)                       # the request's lock
    cache.ensure_free()                       # back to the free-room targets

Visibility (DOMAIN.md rule 3): a host copy becomes visible to `match_prefix`
only when its backup commits, i.e. every layer of every part landed on every
rank. A failed copy aborts the whole backup and releases its reservation;
nothing is ever returned as a partial hit.

Synchronisation: no call blocks on a copy except `LoadOp.wait_layer` (which
on CUDA only orders streams), `settle()` (a server's end-of-forward sync)
and `drain()` (shutdown, tests).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from hicache_cp import cp_mapping
from hicache_cp.agreement import Agreement, LocalAgreement
from hicache_cp.config import Config, WritePolicy
from hicache_cp.errors import ConsistencyError
from hicache_cp.io.base import CopyEngine, CopyTicket, Direction, make_engine
from hicache_cp.layout import Model, Part
from hicache_cp.metrics import CacheMetrics
from hicache_cp.ops import BackupOp, BackupState, LoadOp, LoadState
from hicache_cp.policy import make_policy
from hicache_cp.pools import DevicePool, HostPool
from hicache_cp.radix import HostState, Node, PageKey, RadixTree, page_keys

logger = logging.getLogger(__name__)

_ALL_LAYER_WARN_EVERY = 1000


@dataclass
class MatchResult:
    """What `match_prefix` found. `last_node` is locked until `release`.

    The lengths are fixed at match time. `host_nodes` is the continuation as
    of the match: another request's match may split those nodes later, so
    `load_back` must come right after `match_prefix` (it checks).
    """

    keys: list[PageKey]
    device_pages: np.ndarray  # logical L1 pages of the device-resident prefix
    host_nodes: list[Node]  # committed L2-only continuation, in order
    last_node: Node
    waits: list[LoadOp] = field(default_factory=list)  # loads the device prefix still depends on
    host_len: int = field(init=False)  # pages of the host continuation

    def __post_init__(self) -> None:
        self.host_len = sum(n.num_pages for n in self.host_nodes)

    @property
    def device_len(self) -> int:
        return len(self.device_pages)

    @property
    def prefix_failed(self) -> bool:
        """A load this device prefix waited on aborted: the prefix KV this
        request read is invalid and it must recompute (its own pages are
        already stale and their backups fail)."""
        return any(op.state is LoadState.ABORTED for op in self.waits)

    @property
    def matched_pages(self) -> int:
        return self.device_len + self.host_len

    @property
    def host_pages(self) -> np.ndarray:
        if not self.host_nodes:
            return np.empty(0, dtype=np.int64)
        return np.concatenate([n.host_pages for n in self.host_nodes])  # type: ignore[misc]


class HiCache:
    """The cache manager. One instance per rank; see the module docstring."""

    def __init__(
        self,
        config: Config,
        *,
        device_pool: DevicePool | None = None,
        host_pool: HostPool | None = None,
        engine: CopyEngine | None = None,
        agreement: Agreement | None = None,
        rank: int = 0,
        device: str = "cpu",
    ) -> None:
        self.config = config
        self.layout = config.layout()
        self.rank = rank
        self.cp_size = config.cp_size
        self.device_pool = device_pool or DevicePool(
            self.layout, config.l1_pages, cp_size=config.cp_size, rank=rank, device=device
        )
        self.host_pool = host_pool or HostPool(
            self.layout, config.host_budget_bytes, cp_size=config.cp_size, rank=rank, pin=config.pin_host
        )
        for pool in (self.device_pool, self.host_pool):
            if pool.layout != self.layout or pool.cp_size != self.cp_size:
                raise ValueError("pools were built for another layout or cp_size than the config")
        self.engine = engine or make_engine(config.io_backend, self.device_pool, self.host_pool)
        self.agreement = agreement or LocalAgreement()
        if self.agreement.world_size != self.cp_size:
            raise ValueError(f"agreement spans {self.agreement.world_size} ranks but cp_size is {self.cp_size}")
        self.policy = make_policy(config.eviction_policy)
        self.tree = RadixTree(self.layout.page_size)
        self.metrics = CacheMetrics()
        self.clock = 0
        self._backups: list[BackupOp] = []  # active, creation order
        self._loads: list[LoadOp] = []  # active, creation order
        self._loose_device_pages = 0  # handed out by alloc_device, not yet in the tree
        self._all_parts = frozenset(p.part for p in self.layout.parts)

    # ---- lookup ------------------------------------------------------------------------

    def match_prefix(self, tokens: np.ndarray) -> MatchResult:
        """Longest cached prefix of `tokens`: device pages, then committed host pages.

        Side effects: may split a node (the match ends on a boundary), ticks the
        clock, updates hit counts, locks the path to `last_node`, and under
        `write_through_selective` starts backups of nodes that reached the hit
        threshold. Raises ConsistencyError for a visible host copy missing a
        part. O(matched pages).
        """
        self.clock += 1
        keys = page_keys(tokens, self.layout.page_size)
        path = self.tree.match(keys)
        device: list[np.ndarray] = []
        host_nodes: list[Node] = []
        waits: list[LoadOp] = []
        last = self.tree.root
        for node in path:
            if node.stale_load is not None:
                break  # its L1 pages are being recomputed: a miss, never garbage
            if node.on_device and not host_nodes:
                device.append(node.device_pages)  # type: ignore[arg-type]
                if node.load is not None and node.load not in waits:
                    waits.append(node.load)  # type: ignore[arg-type]
            elif not node.on_device and node.host_visible:
                self._check_parts(node)
                host_nodes.append(node)
            else:
                break
            last = node
        used = path[: path.index(last) + 1] if last is not self.tree.root else []
        for node in used:
            node.hit_count += 1
            node.last_access = self.clock
        self.tree.lock(last)
        dev = np.concatenate(device) if device else np.empty(0, dtype=np.int64)
        m = MatchResult(keys, dev, host_nodes, last, waits)
        self.metrics.record_match(len(tokens), m.device_len, m.host_len, self.layout.page_size)
        if self.config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            for node in used:
                if node.on_device and node.host_state is HostState.NONE and node.hit_count >= self.config.write_threshold:
                    self.start_backup(node)
        self._debug_check()
        return m

    def _check_parts(self, node: Node) -> None:
        if node.host_parts != self._all_parts:
            missing = sorted(p.value for p in self._all_parts - node.host_parts)
            raise ConsistencyError(
                "committed host copy is missing parts",
                node=node.id,
                pages=node.host_pages,
                part=",".join(missing),
                rank=self.rank,
            )

    # ---- L1 pages -------------------------------------------------------------------------

    def alloc_device(self, n: int, first_position: int) -> np.ndarray | None:
        """L1 pages for request positions [first_position, first_position + n).

        Evicts down to the L1 free-room target when needed. Returns None when
        not enough is evictable (the caller must not proceed with the request).
        The caller owns the pages until `insert` or `free_device`.
        """
        if not self._make_room("l1", n, first_position):
            self.metrics.l1_alloc_failures += 1
            logger.warning("rank %d: L1 cannot fit %d pages even after eviction", self.rank, n)
            return None
        pages = self.device_pool.allocator.alloc(n, first_position)
        assert pages is not None
        self._loose_device_pages += n
        return pages

    def free_device(self, pages: np.ndarray) -> None:
        """Return pages from `alloc_device` that never joined the tree."""
        self.device_pool.allocator.free(pages)
        self._loose_device_pages -= len(pages)

    # ---- load back ---------------------------------------------------------------------

    def load_back(self, match: MatchResult) -> LoadOp | None:
        """Start loading the host-only continuation into new L1 pages.

        Allocates L1 (evicting if needed), assigns the pages to the nodes at
        once (they stay locked by the request) and submits H2D for every layer
        of every part in forward order; the forward waits per layer with
        `LoadOp.wait_layer`. Returns None if there is nothing to load, or when
        L1 cannot take it: then the host continuation is dropped from the
        match (it becomes a miss) and the request recomputes those pages.
        """
        if not match.host_nodes:
            return None
        n = match.host_len
        if sum(node.num_pages for node in match.host_nodes) != n:
            raise ConsistencyError(
                "the host continuation was split between match_prefix and load_back",
                node=match.host_nodes[0].id,
                pages=n,
                rank=self.rank,
            )
        first = match.host_nodes[0].first_position
        pages = self.alloc_device(n, first)
        if pages is None:
            self.metrics.loads_skipped += 1
            self._truncate_match(match)
            return None
        self._loose_device_pages -= n
        op = LoadOp(self.layout, pages, match.host_pages, first)
        offset = 0
        for node in match.host_nodes:
            node.device_pages = pages[offset : offset + node.num_pages]
            node.load = op
            op.nodes.append(node)
            offset += node.num_pages
            self.tree.refresh_family(node)
        for model in (Model.TARGET, Model.DRAFT):
            for layer in range(self.layout.num_layers(model)):
                for part in op.layers_to_submit(model, layer):
                    op.record_submit(part, layer, self._submit(op, Direction.H2D, part, layer))
        op.transition(LoadState.LOADING)
        self._loads.append(op)
        self.metrics.loads_started += 1
        logger.debug("rank %d: load %d started, %d pages", self.rank, op.id, n)
        self._debug_check()
        return op

    def _truncate_match(self, match: MatchResult) -> None:
        """Drop the host continuation: the lock moves back to the device prefix."""
        new_last = match.host_nodes[0].parent
        assert new_last is not None
        self.tree.lock(new_last)
        self.tree.unlock(match.last_node)
        self.metrics.l2_hit_tokens -= match.host_len * self.layout.page_size
        self.metrics.miss_tokens += match.host_len * self.layout.page_size
        match.last_node = new_last
        match.host_nodes = []
        match.host_len = 0

    # ---- backup ------------------------------------------------------------------------

    def reserve_backup(self, device_pages: np.ndarray, first_position: int) -> BackupOp | None:
        """Reserve L2 pages for pages the forward is about to compute.

        Only under `write_through`; other policies back up later. The layer
        hooks (`on_layer_end`) submit each layer as it finishes; `insert`
        attaches the op to the new node. Returns None (no backup) when the
        policy does not back up now or L2 cannot make room.
        """
        if self.config.write_policy is not WritePolicy.WRITE_THROUGH or len(device_pages) == 0:
            return None
        host = self._reserve_host(len(device_pages), first_position)
        if host is None:
            return None
        op = BackupOp(self.layout, np.asarray(device_pages, np.int64), host, first_position, layerwise=True)
        self._backups.append(op)
        self.metrics.backups_started += 1
        return op

    def on_layer_end(self, model: Model, layer: int, backups: Iterable[BackupOp | None]) -> None:
        """Layer hook of one forward: `layer` of `model` is written in L1 for the
        requests whose reservations are `backups` (None entries: requests that
        reserved nothing); back that layer up for them.

        Scoped to the forward's own reservations: another request's forward
        may not have written this layer yet. Target hooks copy target parts
        only and draft hooks draft parts only: the draft may not have written
        a layer when the target's hook fires.
        """
        for op in backups:
            if op is None or op.state not in (BackupState.RESERVED, BackupState.WRITING):
                continue
            if not op.layerwise:
                raise ValueError(f"backup {op.id} is an all-layer backup; layer hooks drive reservations only")
            for part in op.layers_to_submit(model, layer):
                op.record_submit(part, layer, self._submit(op, Direction.D2H, part, layer))
                if op.state is BackupState.RESERVED:
                    op.transition(BackupState.WRITING)

    def start_backup(self, node: Node) -> BackupOp | None:
        """Back up an already computed node, every layer at once.

        The all-layer fallback (write_through_selective, write_back): it is not
        overlapped with a forward, so it warns (rate-limited). Returns None
        when L2 cannot make room.
        """
        if not node.on_device or node.host_state is not HostState.NONE or node.load is not None:
            raise ValueError(f"{node} cannot be backed up (needs device pages and no host copy)")
        if node.stale_load is not None:
            raise ValueError(f"{node} cannot be backed up: its L1 pages are awaiting recompute after an aborted load")
        host = self._reserve_host(node.num_pages, node.first_position)
        if host is None:
            return None
        op = BackupOp(self.layout, node.device_pages, host, node.first_position, layerwise=False)  # type: ignore[arg-type]
        op.after, _ = self._prefix_loads(node)  # a stale node is refused above; so is its subtree
        self._attach(op, node)
        self._backups.append(op)
        self.metrics.backups_started += 1
        self.metrics.backups_all_layer += 1
        if self.metrics.backups_all_layer % _ALL_LAYER_WARN_EVERY == 1:
            logger.warning(
                "rank %d: all-layer backup path in use (%s, %d so far): copies are not overlapped with the forward",
                self.rank,
                self.config.write_policy.value,
                self.metrics.backups_all_layer,
            )
        for model in (Model.TARGET, Model.DRAFT):
            for layer in range(self.layout.num_layers(model)):
                for part in op.layers_to_submit(model, layer):
                    op.record_submit(part, layer, self._submit(op, Direction.D2H, part, layer))
        op.transition(BackupState.WRITING)
        return op

    def abort_backup(self, op: BackupOp) -> None:
        """Ask for an abort; the pages are released once nothing is in flight
        on any rank (at a later `poll`)."""
        if op.state in (BackupState.RESERVED, BackupState.WRITING):
            op.transition(BackupState.FAILING)

    def _reserve_host(self, n: int, first_position: int) -> np.ndarray | None:
        if not self._make_room("l2", n, first_position):
            self.metrics.backups_skipped += 1
            return None
        host = self.host_pool.allocator.alloc(n, first_position)
        assert host is not None
        return host

    def _prefix_loads(self, node: Node) -> tuple[list[LoadOp], bool]:
        """Loads still in flight on the root path of `node` (its KV was computed
        on them), and whether a node of that path is stale (a load aborted)."""
        loads: list[LoadOp] = []
        stale = False
        n: Node | None = node
        while n is not None:
            if n.load is not None and n.load not in loads:
                loads.append(n.load)  # type: ignore[arg-type]
            stale = stale or n.stale_load is not None
            n = n.parent
        return loads, stale

    def _attach(self, op: BackupOp, node: Node) -> None:
        node.host_pages = op.host_pages
        node.host_state = HostState.PENDING
        node.backup = op
        op.nodes.append(node)
        self.tree.refresh_family(node)

    # ---- insert --------------------------------------------------------------------------

    def insert(self, match: MatchResult, device_pages: np.ndarray, backup: BackupOp | None = None) -> Node:
        """Add a request's pages to the tree; move its lock to the new last node.

        `device_pages` are the request's pages for positions
        [match.matched_pages, match.matched_pages + len(device_pages)), from
        `alloc_device`; the tree takes them over. Pages another request
        inserted meanwhile are kept and the duplicates freed. `backup` (from
        `reserve_backup` for exactly these pages) is attached so its copy
        becomes visible when it commits; if the pages did not form one new
        node it is aborted instead. Returns the node to `release` later.
        """
        keys = match.keys
        start = match.matched_pages
        device_pages = np.asarray(device_pages, dtype=np.int64)
        if start + len(device_pages) > len(keys):
            raise ValueError(
                f"insert of {len(device_pages)} pages at position {start} exceeds the request's {len(keys)} pages"
            )
        self._loose_device_pages -= len(device_pages)
        path = self.tree.match(keys[: start + len(device_pages)])
        covered = path[-1].end_position if path else 0
        parent = path[-1] if path else self.tree.root
        surplus: list[np.ndarray] = []
        for node in path:
            if node.end_position <= start:
                continue  # the request's own matched prefix
            assert node.first_position >= start, f"{node} straddles the insert boundary {start}"
            lo = node.first_position - start
            mine = device_pages[lo : lo + node.num_pages]
            if node.stale_load is not None and node.lock_ref == 0:
                # stale and held by nobody: this request's fresh pages replace them
                surplus.append(node.device_pages)  # type: ignore[arg-type]
                node.device_pages = mine.copy()
                node.stale_load = None
                self.tree.refresh_family(node)
            elif node.on_device:  # inserted meanwhile by another request: keep the tree's
                surplus.append(mine)
            else:  # evicted from L1 and recomputed by this request
                node.device_pages = mine.copy()
                self.tree.refresh_family(node)
        if surplus:
            self.device_pool.allocator.free(np.concatenate(surplus))
        dup = max(0, covered - start)
        new_node = parent
        rest = device_pages[dup:]
        if len(rest):
            new_node = self.tree.add_child(parent, keys[covered : covered + len(rest)], rest)
            new_node.last_access = self.clock
        if backup is not None:
            backup.after, on_stale = self._prefix_loads(new_node)
            exact = (
                new_node is not parent
                and backup.first_position == new_node.first_position
                and backup.num_pages == new_node.num_pages
            )
            if on_stale:
                backup.error = backup.error or RuntimeError("computed on a prefix whose load aborted")
                self.abort_backup(backup)
            elif exact and backup.state in (BackupState.RESERVED, BackupState.WRITING):
                self._attach(backup, new_node)
            else:
                self.abort_backup(backup)
        self.tree.lock(new_node)
        self.tree.unlock(match.last_node)
        match.last_node = new_node
        self._debug_check()
        return new_node

    def release(self, node: Node) -> None:
        """Drop a request's lock taken by `match_prefix`/`insert`."""
        self.tree.unlock(node)

    # ---- completion ----------------------------------------------------------------------

    def poll(self) -> None:
        """Turn agreed completions into commits and failures into aborts.

        Non-blocking; one collective over the CP group when anything is in
        flight (none otherwise).
        """
        ops: list[BackupOp | LoadOp] = [*self._backups, *self._loads]
        if not ops:
            return
        votes = self.agreement.reduce([op.local_vote() for op in ops])
        decisions = list(zip(ops, votes))
        # Loads first: an aborted load fails the backups computed on top of it
        # (`BackupOp.after`) in the same poll.
        for op, vote in decisions:
            if isinstance(op, LoadOp):
                self._decide_load(op, vote.ok, vote.settled)
        for op, vote in decisions:
            if isinstance(op, BackupOp):
                failing = op.state is BackupState.FAILING
                self._decide_backup(op, vote.ok and not failing, vote.settled)
        self._backups = [op for op in self._backups if op.active]
        self._loads = [op for op in self._loads if op.active]
        self._debug_check()

    def _decide_backup(self, op: BackupOp, ok: bool, settled: bool) -> None:
        if ok and any(load.state is LoadState.ABORTED for load in op.after):
            op.error = op.error or RuntimeError("a load of the prefix these pages were computed on aborted")
            ok = False
        if ok and settled:
            if not op.nodes:  # forward done but `insert` not called yet
                return
            if any(load.active for load in op.after):
                return  # the prefix is still loading: its outcome decides this copy's
            op.transition(BackupState.COMMITTED)
            for node in op.nodes:
                node.host_state = HostState.COMMITTED
                node.host_parts = self._all_parts
                node.backup = None
                self.tree.refresh_family(node)
            self.metrics.backups_committed += 1
            self.metrics.bytes_d2h += op.nbytes
            logger.debug("rank %d: backup %d committed (%d pages)", self.rank, op.id, op.num_pages)
        elif not ok:
            if op.state is not BackupState.FAILING:
                op.transition(BackupState.FAILING)
            if settled:
                self._abort_backup_now(op)

    def _abort_backup_now(self, op: BackupOp) -> None:
        op.transition(BackupState.ABORTED)
        for node in op.nodes:
            node.host_pages = None
            node.host_state = HostState.NONE
            node.host_parts = frozenset()
            node.backup = None
            self.tree.refresh_family(node)
        self.host_pool.allocator.free(op.host_pages)
        self.metrics.backups_aborted += 1
        logger.warning(
            "rank %d: backup %d aborted, %d host pages released: %s", self.rank, op.id, op.num_pages, op.error
        )
        for node in list(op.nodes):
            self._prune(node)

    def _decide_load(self, op: LoadOp, ok: bool, settled: bool) -> None:
        if ok and settled:
            op.transition(LoadState.DONE)
            for node in op.nodes:
                node.load = None
                self.tree.refresh_family(node)
            self.metrics.loads_done += 1
            self.metrics.bytes_h2d += op.nbytes
        elif not ok:
            if op.state is not LoadState.FAILING:
                op.transition(LoadState.FAILING)
            if settled:
                # The L1 pages stay with the nodes (their request still holds
                # them locked) but their bytes are not the cached KV: marked
                # stale (no device hit, no backup) until the request has
                # recomputed them and called `recomputed`. Whatever was
                # computed on top of them is stale for good.
                op.transition(LoadState.ABORTED)
                for node in op.nodes:
                    node.load = None
                    node.stale_load = op
                    self.tree.refresh_family(node)
                self._mark_stale_below(op)  # their backups fail through `BackupOp.after`
                tokens = op.num_pages * self.layout.page_size
                self.metrics.l2_hit_tokens -= tokens
                self.metrics.miss_tokens += tokens
                self.metrics.loads_aborted += 1
                logger.warning(
                    "rank %d: load %d aborted, its %d L1 pages must be recomputed: %s",
                    self.rank, op.id, op.num_pages, op.error,
                )

    def _mark_stale_below(self, load: LoadOp) -> None:
        """Mark the L1 nodes under an aborted load's nodes stale: a forward that
        waited on the load may have computed them from invalid KV. (Some were
        loaded from a valid host copy instead; treating them as misses too
        keeps the rule simple, and loads rarely abort.)"""
        top = min(load.nodes, key=lambda n: n.first_position)
        own = set(map(id, load.nodes))
        stack = list(top.children.values())
        while stack:
            node = stack.pop()
            if node.on_device and node.load is None and id(node) not in own:  # loading: bytes from L2, valid
                node.stale_load = load
            stack.extend(node.children.values())

    def recomputed(self, load: LoadOp) -> None:
        """The request of aborted `load` rewrote the loaded L1 pages: they are
        cached KV again. Call it before releasing the request.

        Until this call those nodes are no device hit and are never backed up.
        Nodes computed on top of the aborted load stay stale: a later insert
        of freshly computed pages replaces them.
        """
        if load.state is not LoadState.ABORTED:
            raise ValueError(f"load {load.id} is {load.state.value}, not aborted: nothing to recompute")
        for node in load.nodes:
            if node.stale_load is load:
                if node.lock_ref == 0:
                    raise ValueError(f"{node}: recomputed() after the request released it")
                node.stale_load = None
                self.tree.refresh_family(node)
        self._debug_check()

    def settle(self) -> None:
        """Wait for every copy in flight on this rank, then poll once (blocks).

        Every op that had all its layers submitted is decided afterwards
        (committed or aborted) identically on every rank, so the cache state no
        longer depends on copy timing. A server calls it where it syncs anyway
        (the end of a forward); on CP ranks every rank must call it at the same
        step, like `poll`.
        """
        for op in [*self._backups, *self._loads]:
            for t in op.inflight:
                try:
                    t.wait()
                except Exception:  # recorded in the op's vote
                    pass
        self.poll()

    def drain(self, timeout_polls: int = 1_000_000) -> None:
        """Settle until nothing is in flight (shutdown and tests; blocks)."""
        for _ in range(timeout_polls):
            if not self._backups and not self._loads:
                return
            self.settle()
            if any(op.nodes == [] and op.state is not BackupState.FAILING for op in self._backups):
                break  # unattached backups wait for their insert
        if self._loads or any(op.nodes for op in self._backups):
            raise RuntimeError(f"rank {self.rank}: ops still in flight after drain: {self._backups + self._loads}")

    # ---- eviction ------------------------------------------------------------------------

    def ensure_free(self) -> None:
        """Evict each tier back up to its free-room target when under it.

        Evicts until the target is reached, not just the deficit (DOMAIN.md
        rule 5), or until nothing more is evictable.
        """
        self._make_room("l1", 0, 0)
        self._make_room("l2", 0, 0)
        self._debug_check()

    def _make_room(self, tier: str, need: int, first_position: int) -> bool:
        pool = self.device_pool if tier == "l1" else self.host_pool
        alloc = pool.allocator
        target = self.config.free_room_pages(tier, alloc.capacity)
        if alloc.free_pages >= target + need and alloc.fits(need, first_position):
            return True
        goal = min(target + need, alloc.capacity)
        leaves = self.tree.device_leaves if tier == "l1" else self.tree.host_leaves
        heap = [(self.policy.key(n), n.id, n) for n in leaves]
        heapq.heapify(heap)
        while heap and not (alloc.free_pages >= goal and alloc.fits(need, first_position)):
            _, _, node = heapq.heappop(heap)
            if node not in leaves:
                continue
            parent = self._evict_l1(node) if tier == "l1" else self._evict_l2(node)
            if parent is not None and parent in leaves:
                heapq.heappush(heap, (self.policy.key(parent), parent.id, parent))
        return alloc.fits(need, first_position)

    def _evict_l1(self, node: Node) -> Node | None:
        stale = node.stale_load is not None  # garbage: dropped, never backed up
        if self.config.write_policy is WritePolicy.WRITE_BACK and node.host_state is HostState.NONE and not stale:
            if self.start_backup(node) is not None:
                return None  # evictable once the backup commits
        pages = node.device_pages
        assert pages is not None
        node.device_pages = None
        node.stale_load = None
        self.device_pool.allocator.free(pages)
        self.metrics.evictions_l1 += len(pages)
        self.tree.refresh_family(node)
        parent = node.parent
        self._prune(node)
        return parent

    def _evict_l2(self, node: Node) -> Node | None:
        pages = node.host_pages
        assert pages is not None and node.host_state is HostState.COMMITTED
        node.host_pages = None
        node.host_state = HostState.NONE
        node.host_parts = frozenset()
        self.host_pool.allocator.free(pages)
        self.metrics.evictions_l2 += len(pages)
        self.tree.refresh_family(node)
        parent = node.parent
        self._prune(node)
        return parent

    def _prune(self, node: Node) -> None:
        """Remove nodes that hold nothing, walking up while they do."""
        while (
            node is not self.tree.root
            and node.parent is not None
            and not node.children
            and node.device_pages is None
            and node.host_state is HostState.NONE
            and node.lock_ref == 0
        ):
            node = self.tree.remove_leaf(node)

    # ---- io ----------------------------------------------------------------------------

    def _submit(self, op: BackupOp | LoadOp, direction: Direction, part: Part, layer: int) -> list[CopyTicket]:
        """Submit this rank's share of one layer of one part; [] if it owns none."""
        dev, host = op.device_pages, op.host_pages
        if self.cp_size > 1:
            mine = cp_mapping.owned_mask(dev, self.rank, self.cp_size)
            if not mine.any():
                return []
            dev, host = dev[mine], host[mine]
        dev = cp_mapping.to_physical(dev, self.cp_size)
        host = cp_mapping.to_physical(host, self.cp_size)
        if direction is Direction.D2H:
            return [self.engine.submit_backup(part, layer, dev, host)]
        return [self.engine.submit_load(part, layer, host, dev)]

    # ---- introspection -----------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        """A snapshot of the counters and both tiers' occupancy."""
        d = self.metrics.as_dict()
        for tier, pool in (("l1", self.device_pool), ("l2", self.host_pool)):
            a = pool.allocator
            d[f"{tier}_capacity_pages"] = a.capacity
            d[f"{tier}_free_pages"] = a.free_pages
            d[f"{tier}_fragmentation"] = a.fragmentation()
            d[f"{tier}_lane_free_pages"] = a.lane_free_pages()  # lane r: the pages rank r holds
        d["backups_in_flight"] = len(self._backups)
        d["loads_in_flight"] = len(self._loads)
        return d

    def in_flight(self) -> tuple[list[BackupOp], list[LoadOp]]:
        return list(self._backups), list(self._loads)

    def check_invariants(self) -> None:
        """Assert every cross-structure invariant (O(tree size)); see the docs."""
        self.tree.check_invariants()
        self.device_pool.allocator.check_invariants()
        self.host_pool.allocator.check_invariants()
        nodes = list(self.tree.nodes())
        dev = [n.device_pages for n in nodes if n.device_pages is not None]
        dev_all = np.concatenate(dev) if dev else np.empty(0, np.int64)
        assert len(np.unique(dev_all)) == len(dev_all), "an L1 page is owned by two nodes"
        assert self.device_pool.allocator.used_pages == len(dev_all) + self._loose_device_pages, (
            f"L1 leak: allocator uses {self.device_pool.allocator.used_pages}, tree holds {len(dev_all)}, "
            f"requests hold {self._loose_device_pages}"
        )
        host = [n.host_pages for n in nodes if n.host_pages is not None]
        host += [op.host_pages for op in self._backups if not op.nodes]
        host_all = np.concatenate(host) if host else np.empty(0, np.int64)
        assert len(np.unique(host_all)) == len(host_all), "an L2 page is owned twice"
        assert self.host_pool.allocator.used_pages == len(host_all), (
            f"L2 leak: allocator uses {self.host_pool.allocator.used_pages}, tree and reservations hold {len(host_all)}"
        )
        for n in nodes:
            if n.host_state is HostState.COMMITTED:
                assert n.host_parts == self._all_parts, f"{n}: committed without every part"
            if n.backup is not None:
                assert n.backup in self._backups and n.backup.active, f"{n}: backup not tracked"  # type: ignore[operator]
            if n.load is not None:
                assert n.load in self._loads, f"{n}: load not tracked"  # type: ignore[operator]
        for op in self._backups:
            for n in op.nodes:
                assert n.backup is op and n.host_state is HostState.PENDING, f"backup {op.id}: {n} not pending on it"

    def _debug_check(self) -> None:
        if self.config.debug_checks:
            self.check_invariants()

    def close(self) -> None:
        """Stop the io engine and release pinned host memory."""
        self.engine.close()
        self.host_pool.close()

    def __enter__(self) -> HiCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
