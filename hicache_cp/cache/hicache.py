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

Visibility (docs/invariants.md rule 3): a host copy becomes visible to `match_prefix`
only when its backup commits, i.e. every layer of every part landed on every
rank. A failed copy aborts the whole backup and releases its reservation;
nothing is ever returned as a partial hit.

Synchronisation: no call blocks on a copy except `LoadOp.wait_layer` (which
on CUDA only orders streams), `settle()` (a server's end-of-forward sync)
and `drain()` (shutdown, tests).

This class is a facade: the work happens in `prefix` (match, insert),
`lifecycle` (backups and loads, decisions), `eviction` (space and free room)
over one shared `state.CacheState`; `build` sizes L2 (`host_budget`) and
opens the L3 tier (`make_tier3`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from hicache_cp.cache.build import host_budget, make_tier3
from hicache_cp.cache.engine_l1 import EngineL1
from hicache_cp.cache.eviction import Evictor
from hicache_cp.cache.lifecycle import Lifecycle
from hicache_cp.cache.node_tier import NodeTier, node_budget
from hicache_cp.match import MatchResult
from hicache_cp.cache.prefix import Prefixes
from hicache_cp.cache.state import CacheState
from hicache_cp.cache.store_events import StoreEvents
from hicache_cp.cache.tier3 import Tier3
from hicache_cp.checksum import Verify
from hicache_cp.config import Config
from hicache_cp.events import EventLog, Medium
from hicache_cp.cp.agreement import Agreement, LocalAgreement
from hicache_cp.io.base import CopyEngine, make_engine
from hicache_cp.l3.ops import PrefetchOp, PrefetchState
from hicache_cp.l3.store import KVStore
from hicache_cp.layout import KVLayout, Model
from hicache_cp.metrics import CacheMetrics
from hicache_cp.ops import BackupOp, LoadOp
from hicache_cp.policy import EvictionPolicy, make_policy
from hicache_cp.pools import DevicePool, HostPool
from hicache_cp.radix import Node, RadixTree

logger = logging.getLogger(__name__)


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
        l3_store: KVStore | None = None,
        engine_options: Mapping[str, Any] | None = None,
        events: EventLog | None = None,
        node: NodeTier | None = None,
    ) -> None:
        """`node`: the node tier, when a plug-in built it (vLLM: the scheduler keeps the
        journal, the workers hold the copies); else made here when `config.node_segment`
        names a segment, with this rank's L2 in it (docs/node-tier.md)."""
        layout = config.layout()
        agreement = agreement or LocalAgreement()
        if agreement.world_size != config.cp_size and config.cp_size != 1:
            # cp_size 1 with more ranks: replicas (an engine's TP ranks) that agree on every decision
            raise ValueError(f"agreement spans {agreement.world_size} ranks but cp_size is {config.cp_size}")
        device_pool = device_pool or DevicePool(layout, config.l1_pages, cp_size=config.cp_size, rank=rank, device=device)
        own_host, own_engine, own_node = host_pool is None, engine is None, node is None and bool(config.node_segment)
        if own_node:
            budget = node_budget(config, host_budget(config, agreement, rank), agreement.world_size)
            node = NodeTier(config, layout, agreement, budget, rank=rank)
        try:
            host_pool = host_pool or (node.host_pool(config.pin_host) if node is not None else HostPool(
                layout, host_budget(config, agreement, rank), cp_size=config.cp_size, rank=rank, pin=config.pin_host,
                checksums=config.verify_restores is not Verify.OFF,
            ))  # fmt: skip
        except BaseException:
            if own_node and node is not None:
                node.close()
            raise
        try:
            for pool in (device_pool, host_pool):
                if pool.layout != layout or pool.cp_size != config.cp_size:
                    raise ValueError("pools were built for another layout or cp_size than the config")
            config.check_free_room("l1", device_pool.allocator.capacity)
            config.check_free_room("l2", host_pool.allocator.capacity)
            engine = engine or make_engine(config.io_backend, device_pool, host_pool, **(engine_options or {}))
            engine.verify = verify = config.verify_restores  # (the node tier's checksum table is shared)
            if verify is not Verify.OFF and host_pool.arenas and not host_pool.has_checksums:
                raise ValueError(f"verify_restores = {verify.value} needs a host pool with "
                                 "checksums (HostPool(checksums=True))")  # fmt: skip
            engine.warm_up()  # one-time costs (the checksum kernel's build) here, not in a step
            self._state = CacheState(
                config=config,
                layout=layout,
                rank=rank,
                cp_size=config.cp_size,
                device_pool=device_pool,
                host_pool=host_pool,
                engine=engine,
                agreement=agreement,
                policy=make_policy(config.eviction_policy),
                tree=RadixTree(layout.page_size),
            )
            self._evictor = Evictor(self._state)
            self._lifecycle = Lifecycle(self._state, self._evictor)
            self._prefixes = Prefixes(self._state, self._lifecycle)
            self._engine_l1 = EngineL1(self._state, self._lifecycle)
            self._evictor.backup_victim = lambda node: self._lifecycle.start_backup(node) is not None
            self._evictor.settle_backups = self._lifecycle.settle
            self._evictor.poll = self._lifecycle.poll
            self._node, self._own_node = node, own_node
            if node is not None:  # adopted copies: committed, tagged, checked at their first load
                self._state.node = node
                node.adopt(self._state.tree, host_pool)
            self._tier3: Tier3 | None = None
            if config.l3.enabled or l3_store is not None:
                self._tier3 = make_tier3(self._state, self._evictor, l3_store)
            if events is not None:
                self.attach_events(events)
        except BaseException:
            # A failed construction leaves nothing running: what it made, it closes (what the
            # caller handed in stays the caller's).
            if own_engine and engine is not None:
                engine.close()
            if own_host:
                host_pool.close()
            if own_node and node is not None:
                node.close()
            raise

    # ---- what the cache is built of (read-only views) ---------------------------------

    @property
    def config(self) -> Config:
        return self._state.config

    @property
    def layout(self) -> KVLayout:
        return self._state.layout

    @property
    def rank(self) -> int:
        return self._state.rank

    @property
    def cp_size(self) -> int:
        return self._state.cp_size

    @property
    def device_pool(self) -> DevicePool:
        return self._state.device_pool

    @property
    def host_pool(self) -> HostPool:
        return self._state.host_pool

    @property
    def engine(self) -> CopyEngine:
        return self._state.engine

    @property
    def agreement(self) -> Agreement:
        return self._state.agreement

    @property
    def policy(self) -> EvictionPolicy:
        return self._state.policy

    @property
    def tree(self) -> RadixTree:
        return self._state.tree

    @property
    def metrics(self) -> CacheMetrics:
        return self._state.metrics

    @property
    def events(self) -> EventLog | None:
        """The KV cache event log (`hicache_cp.events`), if one is attached."""
        return self._state.events

    def attach_events(self, log: EventLog) -> None:
        """Announce this cache's blocks to `log` from now on (see `hicache_cp.events`).

        Only right after construction (nothing in flight, nothing in L1): the log
        first gets AllCleared, so a router drops whatever this server (or a cache
        before it on the same log) announced, then BlockStored (HOST) for every
        copy the node tier adopted, parents first. ValueError otherwise."""
        s = self._state
        nodes = list(s.tree.nodes())
        if s.events is not None or s.backups or s.loads or any(n.on_device for n in nodes):
            raise ValueError("attach_events: the cache already has an event log or holds blocks in L1 or in flight")
        log.bind(s.layout.page_size)
        s.events = log
        if self._tier3 is not None:
            self._tier3.events = StoreEvents(log)
        log.cleared()
        for node in sorted((n for n in nodes if n.host_visible), key=lambda n: n.first_position):
            log.stored(Medium.HOST, node)

    @property
    def l3(self) -> Tier3 | None:
        """The L3 tier, when configured (`config.l3` or an `l3_store`)."""
        return self._tier3

    # ---- lookup ------------------------------------------------------------------------

    def match_prefix(
        self, tokens: np.ndarray, request: object = None, *, count: bool = True, checked_from: int = 0
    ) -> MatchResult:
        """Longest cached prefix of `tokens`: device pages, then committed host pages.
        `request` (an id) names the request in the warnings of its loads and backups.
        `count=False` leaves the request out of the hit metrics (L3's share included): an
        engine that matches a request several times before admitting it, and owns L1,
        counts it once itself (`metrics.record_match`). `checked_from`: an engine that
        owns L1 and holds the first `checked_from` pages itself loads none of them, so
        the host copies' identity is checked from there on only (`load_into` refuses
        to load below it).

        Side effects: may split a node (the match ends on a boundary), ticks the
        clock, updates hit counts, locks the path to `last_node`, and under
        `write_through_selective` starts backups of nodes that reached the hit
        threshold. Raises ConsistencyError for a visible host copy missing a
        part. O(matched pages).

        With an L3 tier, host pages whose copies an L3 prefetch landed and no
        request used yet count as L3 hits (`m.l3_len`), once per landed copy;
        the other host pages count as L2 hits.
        """
        m = self._prefixes.match_prefix(tokens, count, checked_from)
        m.request = request
        if self._tier3 is not None and count:
            self._tier3.claim(m)
        self._state.debug_check()
        return m

    # ---- L1 pages ----------------------------------------------------------------------

    def alloc_device(self, n: int, first_position: int) -> np.ndarray | None:
        """L1 pages for request positions [first_position, first_position + n).

        Evicts down to the L1 free-room target when needed. Returns None when
        not enough is evictable (the caller must not proceed with the request).
        The caller owns the pages until `insert` or `free_device`. Under
        `write_back`, victims without a host copy are backed up first; when the
        pages do not fit without them it waits for those copies (`settle`, so
        every CP rank must call it at the same step, as it does anyway).
        """
        return self._evictor.alloc_device(n, first_position)

    def free_device(self, pages: np.ndarray) -> None:
        """Return pages from `alloc_device` that never joined the tree."""
        self._evictor.free_device(pages)

    # ---- load back ---------------------------------------------------------------------

    def load_back(self, match: MatchResult) -> LoadOp | None:
        """Start loading the host-only continuation into new L1 pages.

        Allocates L1 (evicting if needed), assigns the pages to the nodes at
        once (they stay locked by the request) and submits H2D for every layer
        of every part in forward order; the forward waits per layer with
        `LoadOp.wait_layer`. Returns None if there is nothing to load, or when
        L1 cannot take it: then the host continuation is dropped from the
        match (it becomes a miss) and the request recomputes those pages.

        With an L3 tier and no `prefetch(match)` call before, it first runs
        `prefetch(match)` in the configured mode (`config.l3.prefetch_wait`).
        """
        if self._tier3 is not None and not match.l3_checked:
            self.prefetch(match)
        op = self._lifecycle.load_back(match)
        if self._tier3 is not None:
            self._tier3.note_load(match, op)
        self._state.debug_check()
        return op

    # ---- engine-owned L1 (an engine such as vLLM manages the device pages) -------------

    def load_into(self, match: MatchResult, device_pages: np.ndarray, first_position: int) -> LoadOp:
        """Load pages of the matched host continuation into pages the engine owns.

        For a cache whose tree holds host copies only (`hicache_cp.cache.engine_l1`):
        request positions [first_position, first_position + len(device_pages))
        must lie inside `match`'s host continuation; every layer of every part
        is submitted H2D in forward order and the forward waits per layer with
        `LoadOp.wait_layer`. The op is attached to no node: the caller keeps
        `match` locked until a `poll` decided it. ValueError when the range is
        outside the continuation; ConsistencyError if it was split since the match.
        """
        op = self._engine_l1.load_into(match, device_pages, first_position)
        self._state.debug_check()
        return op

    def loads_read(self, loads: Iterable[LoadOp]) -> None:
        """Every kernel of the forward that reads `loads` is enqueued on the caller's
        current stream: their restore checks follow that forward, not what is queued
        after it (`CopyEngine.pin_checks_order`). Never blocks."""
        self.engine.pin_checks_order([op.plan for op in loads if op.plan is not None])

    def reserve_host_copy(
        self, tokens: np.ndarray, device_pages: np.ndarray, after: Sequence[LoadOp] = ()
    ) -> list[BackupOp]:
        """Write-through of a request's whole pages that L2 lacks, from engine-owned pages.

        `device_pages[i]` holds page i of `tokens` (whole pages, already computed
        or computed by this forward before its layer hooks). Pages already in
        L2 (committed or pending) are skipped; the others get reservations
        attached at once to PENDING host-only nodes (invisible until commit),
        driven by `on_layer_end` like `reserve_backup`'s. Backups computed on
        top of an undecided load pass it in `after`: they fail if it aborts.
        Returns the new ops (none when everything is in L2, the policy is not
        write-through, or L2 cannot make room). O(pages matched).
        """
        return self._engine_l1.reserve_host_copy(tokens, device_pages, after)

    # ---- L3 ----------------------------------------------------------------------------

    def prefetch(self, match: MatchResult, wait: bool | None = None) -> PrefetchOp | None:
        """Fetch the L3 continuation of `match` into L2 (call it right after
        `match_prefix`, before `load_back`).

        Looks up which objects after the L2 continuation exist, agrees on
        their length with the CP group (one MIN collective: every rank calls
        this at the same step), reserves L2 pages and starts reading. The
        pages are invisible until every part landed on every rank (an agreed
        poll). With `wait` (default `config.l3.prefetch_wait`) it blocks until
        then or until the deadline (`prefetch_timeout_s`), polling in
        between, and on success the match grows by the fetched pages (then
        `load_back` loads them like any L2 hit). Without, the request goes on
        without them and they serve later requests (the first match that uses
        a landed page counts it as an L3 hit); a server that knows its
        requests before it schedules them calls `prefetch_queued` instead.
        Returns None when there is nothing to fetch, no L3 tier, the store is
        down, L2 has no room, or (not waiting) an active prefetch already
        reads from the match's end.
        """
        if self._tier3 is None or match.l3_checked:  # once per match
            match.l3_checked = True
            return None
        wait = self.config.l3.prefetch_wait if wait is None else wait
        op = self._tier3.prefetch(match, wait)
        if op is not None and wait:
            while op.state is PrefetchState.FETCHING:  # agreed state: every rank loops alike
                self._tier3.wait_local(op)
                self._lifecycle.poll()
        self._state.debug_check()
        return op

    def prefetch_queued(self, tokens: np.ndarray) -> PrefetchOp | None:
        """Start fetching the L3 continuation of a request that is queued but
        not scheduled yet (call it when the request arrives); never waits.

        The pages land in L2 while other requests compute; when the request
        is scheduled later, `match_prefix` finds what was committed by then
        (counted as L3 hits), and `load_back` loads it like any L2 hit. It
        counts no request and no hit, and keeps no lock (a later eviction
        costs the fetch, never a stuck path). Same contract otherwise as
        `prefetch(match, wait=False)`: one lookup and one MIN collective
        (every CP rank calls it at the same step), pages invisible until every
        part landed on every rank. Returns None when nothing is fetched.
        """
        if self._tier3 is None:
            return None
        m = self._prefixes.peek(tokens)
        try:
            op = self._tier3.prefetch_queued(m)
        finally:
            self._state.tree.unlock(m.last_node)
        self._state.debug_check()
        return op

    def cancel_prefetch(self, op: PrefetchOp) -> None:
        """Abort a prefetch at the next poll; its pages are released once its
        reads returned on every rank."""
        if self._tier3 is not None:
            self._tier3.cancel(op)

    def recomputed(self, load: LoadOp) -> None:
        """The request of aborted `load` rewrote the loaded L1 pages: they are
        cached KV again. Call it before releasing the request.

        Until this call those nodes are no device hit and are never backed up.
        Nodes computed on top of the aborted load stay stale: a later insert
        of freshly computed pages replaces them.
        """
        self._lifecycle.recomputed(load)
        self._state.debug_check()

    # ---- backup ------------------------------------------------------------------------

    def reserve_backup(self, device_pages: np.ndarray, first_position: int) -> BackupOp | None:
        """Reserve L2 pages for pages the forward is about to compute.

        Only under `write_through`; other policies back up later. The layer
        hooks (`on_layer_end`) submit each layer as it finishes; `insert`
        attaches the op to the new node. Returns None (no backup) when the
        policy does not back up now or L2 cannot make room.
        """
        return self._lifecycle.reserve_backup(device_pages, first_position)

    def on_layer_end(self, model: Model, layer: int, backups: Iterable[BackupOp | None]) -> None:
        """Layer hook of one forward: `layer` of `model` is written in L1 for the
        requests whose reservations are `backups` (None entries: requests that
        reserved nothing); back that layer up for them.

        Scoped to the forward's own reservations: another request's forward
        may not have written this layer yet. Target hooks copy target parts
        only and draft hooks draft parts only: the draft may not have written
        a layer when the target's hook fires.
        """
        self._lifecycle.on_layers_end(model, range(layer, layer + 1), backups)

    def on_layers_end(self, model: Model, layers: range, backups: Iterable[BackupOp | None]) -> None:
        """`on_layer_end` for a run of consecutive `layers` of `model` written in L1 (a
        hook that reports several layers at once): per op, one engine call for all of
        them, in layer order."""
        self._lifecycle.on_layers_end(model, layers, backups)

    def start_backup(self, node: Node) -> BackupOp | None:
        """Back up an already computed node, every layer at once.

        The all-layer fallback (write_through_selective, write_back): it is not
        overlapped with a forward, so it warns (rate-limited). Returns None
        when L2 cannot make room.
        """
        return self._lifecycle.start_backup(node)

    def abort_backup(self, op: BackupOp) -> None:
        """Ask for an abort; the pages are released once nothing is in flight
        on any rank (at a later `poll`)."""
        self._lifecycle.abort_backup(op)

    # ---- insert ------------------------------------------------------------------------

    def insert(self, match: MatchResult, device_pages: np.ndarray, backup: BackupOp | None = None) -> Node:
        """Add a request's pages to the tree; move its lock to the new last node.

        `device_pages` are the request's pages for positions
        [match.matched_pages, match.matched_pages + len(device_pages)), from
        `alloc_device`; the tree takes them over. Pages another request
        inserted meanwhile are kept and the duplicates freed, except where the
        tree's copy has no host copy, nobody holds it and `backup` is live:
        then this request's pages replace it (their copy is in flight).

        `backup` (from `reserve_backup` for exactly these pages, else
        ValueError) is attached to every node that took its pages and has no
        host copy, each visible when the op commits; it is trimmed of the
        positions the tree already held otherwise (their host pages are freed
        at the decision) and aborted when none is left or it sits on a stale
        prefix. Returns the node to `release` later. O(pages inserted).
        """
        node = self._prefixes.insert(match, device_pages, backup)
        self._state.debug_check()
        return node

    def release(self, node: Node) -> None:
        """Drop a request's lock taken by `match_prefix`/`insert`."""
        self._state.tree.unlock(node)

    # ---- completion --------------------------------------------------------------------

    def poll(self) -> None:
        """Turn agreed completions into commits and failures into aborts.

        Non-blocking; one collective over the CP group when anything is in
        flight (none otherwise).
        """
        self._lifecycle.poll()
        self._state.debug_check()

    def settle(self) -> None:
        """Wait for every copy in flight on this rank, then poll once (blocks).

        Every op that had all its layers submitted is decided afterwards
        (committed or aborted) identically on every rank, so the cache state no
        longer depends on copy timing. A server calls it where it syncs anyway
        (the end of a forward); on CP ranks every rank must call it at the same
        step, like `poll`.
        """
        self._lifecycle.settle()
        self._state.debug_check()

    def drain(self, timeout_polls: int = 1_000_000) -> None:
        """Settle until nothing is in flight (shutdown and tests; blocks)."""
        self._lifecycle.drain(timeout_polls)

    # ---- eviction ----------------------------------------------------------------------

    def ensure_free(self) -> None:
        """Evict each tier back up to its free-room target when under it.

        Evicts until the target is reached, not just the deficit (docs/invariants.md
        rule 5), or until nothing more is evictable.
        """
        self._evictor.ensure_free()
        self._state.debug_check()

    def evict_device(self) -> None:
        """Evict every unlocked L1 page now, as L1 pressure would (the policy's order;
        committed host copies stay): probes and benchmarks use it to make a cached
        prefix L2-only. Under `write_back`, victims without a host copy are backed
        up first and it waits for those backups (`settle`: every CP rank calls it at
        the same step)."""
        self._evictor.make_room("l1", self.device_pool.allocator.capacity, 0)
        self._state.debug_check()

    # ---- introspection -----------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        """A snapshot of the counters and both tiers' occupancy."""
        s = self._state
        d = s.metrics.as_dict()
        for tier, pool in (("l1", s.device_pool), ("l2", s.host_pool)):
            a = pool.allocator
            d[f"{tier}_capacity_pages"] = a.capacity
            d[f"{tier}_free_pages"] = a.free_pages
            d[f"{tier}_fragmentation"] = a.fragmentation()
            d[f"{tier}_lane_free_pages"] = a.lane_free_pages()  # lane r: the pages rank r holds
        if self._node is not None:
            d.update(self._node.stats())
        d["backups_in_flight"] = len(s.backups)
        d["loads_in_flight"] = len(s.loads)
        d["verify_restores"] = s.config.verify_restores.value
        units = sum(p.num_slots for p in s.layout.parts)
        d.update(s.engine.integrity.as_dict(units))
        d["integrity"] = s.engine.integrity.families(units, s.metrics.integrity_dropped_pages)
        if self._tier3 is not None:
            d.update(self._tier3.stats())
            m = s.metrics  # L3 hits are hits too
            hits = m.l1_hit_tokens + m.l2_hit_tokens + self._tier3.metrics.l3_hit_tokens
            d["hit_rate"] = hits / m.prompt_tokens if m.prompt_tokens else 0.0
        return d

    def in_flight(self) -> tuple[list[BackupOp], list[LoadOp]]:
        """The backups and loads not yet decided, in creation order."""
        return list(self._state.backups), list(self._state.loads)

    def check_invariants(self) -> None:
        """Assert every cross-structure invariant (O(tree size)); see the docs."""
        self._state.check_invariants()

    def close(self, *, discard: bool = False) -> None:
        """Stop the L3 workers and the io engine, release pinned host memory.

        `discard` (a reset, after `drain`): the node tier's journal forgets every
        copy, so the next cache on the segment adopts none. An L3 call still
        running after `l3.close_timeout_s` may still touch the L2 arenas: they are
        then left mapped (logged)."""
        if discard and self._node is not None:
            self._node.clear()
        arenas_free = self._tier3.close() if self._tier3 is not None else True
        self._state.engine.close()
        if arenas_free:
            self._state.host_pool.close()
            if self._own_node and self._node is not None:
                self._node.close()  # unmap; drops the segment when `node_drop_on_close` and last

    def __enter__(self) -> HiCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
