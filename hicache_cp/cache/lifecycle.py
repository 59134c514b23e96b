"""Backups and loads from start to decision, driven by the ops state machines.

    load_back(match)            L1 pages for the host continuation, H2D of every layer
    reserve_backup(pages, pos)  write-through: L2 reservation for pages about to be computed
    on_layers_end(model, ls, ops) one forward's layer hook: D2H of those layers for its ops
    start_backup(node)          the all-layer fallback (selective write-through, write-back)
    poll()                      agreed acks -> commits / done loads, failures -> aborts
    settle(), drain()           wait for copies, then decide (end of forward, shutdown)

Every decision goes through `poll`, which condenses each op in flight into a
vote and reduces the votes over the CP group in one collective (docs/invariants.md
rule 7): all ranks commit, wait or abort the same op at the same step. A
backup's host copy turns visible only at its commit (rule 3); a failed copy
aborts the whole op and releases its reservation (nothing partial is ever
visible). An aborted load leaves its L1 pages *stale* until its request has
recomputed them (`recomputed`); whatever was computed on top of them is
stale for good and its backups fail (`BackupOp.after`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import numpy as np

from hicache_cp.cache.eviction import Evictor
from hicache_cp.match import MatchResult
from hicache_cp.cache.state import CacheState
from hicache_cp.checksum import Verify, sample_positions
from hicache_cp.config import WritePolicy
from hicache_cp.cp import mapping as cp_mapping
from hicache_cp.cp.agreement import Vote
from hicache_cp.errors import ConsistencyError
from hicache_cp.io.base import CopyPlan, CopyTicket, Direction
from hicache_cp.keys import PrefixHashMemo
from hicache_cp.layout import Model, Part
from hicache_cp.ops import BackupOp, BackupState, LoadOp, LoadState
from hicache_cp.radix import HostState, Node

logger = logging.getLogger(__name__)

_ALL_LAYER_WARN_EVERY = 1000
_RESERVED, _WRITING = BackupState.RESERVED, BackupState.WRITING


class Lifecycle:
    """Starts backups and loads, submits their copies and decides them."""

    def __init__(self, state: CacheState, evictor: Evictor) -> None:
        self.s = state
        self.evictor = evictor
        self._hashes = PrefixHashMemo(state.layout.page_size)  # a request's prompt hashed once

    # ---- load back ---------------------------------------------------------------------

    def load_back(self, match: MatchResult) -> LoadOp | None:
        """See `HiCache.load_back`."""
        s = self.s
        if not match.host_nodes:
            return None
        n = match.host_len
        if sum(node.num_pages for node in match.host_nodes) != n:
            raise ConsistencyError(
                "the host continuation was split between match_prefix and load_back",
                node=match.host_nodes[0].id,
                pages=n,
                rank=s.rank,
            )
        first = match.host_nodes[0].first_position
        if first < match.checked_from:
            raise ValueError(f"load_back: the match was checked from page {match.checked_from} only (load_into's "
                             f"checked_from), its continuation starts at {first}")  # fmt: skip
        pages = self.evictor.alloc_device(n, first)
        if pages is None:
            s.metrics.loads_skipped += 1
            self._truncate_match(match)
            return None
        s.loose_device_pages -= n
        op = LoadOp(s.layout, pages, match.host_pages, first, self._local_pages(pages), s.rank)
        op.request = match.request
        offset = 0
        for node in match.host_nodes:
            node.device_pages = pages[offset : offset + node.num_pages]
            node.load = op
            op.nodes.append(node)
            offset += node.num_pages
            s.tree.refresh_family(node)
            s.device_changed(node, stored=True)
        op.sources = op.nodes  # their identity was checked by match_prefix (`Prefixes._first_stale`)
        self._submit_all_layers(op, Direction.H2D)
        op.transition(LoadState.LOADING)
        s.loads.append(op)
        s.metrics.loads_started += 1
        logger.debug("rank %d: load %d started, %d pages", s.rank, op.id, n)
        return op

    # ---- identity of host copies (`HostPool.tags`) -------------------------------------

    @property
    def verifying(self) -> bool:
        return self.s.config.verify_restores is not Verify.OFF

    def identity(self, tokens: np.ndarray, lo: int, hi: int) -> np.ndarray | None:
        """The identity tags (prefix hashes) of request positions [lo, hi) of `tokens`
        (whole pages from position 0), read-only; None when checks are off. O(hi pages'
        tokens) to compare, and to hash only the pages the last call did not share
        (`keys.PrefixHashMemo`: a request's matches and its reservation ask alike)."""
        if not self.verifying:
            return None
        return self._hashes.first(tokens, hi)[lo:hi]

    def _truncate_match(self, match: MatchResult, keep: int = 0) -> None:
        """Drop the host continuation after its first `keep` nodes: the lock moves back
        to the last node kept (the device prefix's when none is)."""
        s = self.s
        dropped = match.host_nodes[keep:]
        new_last = dropped[0].parent
        assert new_last is not None
        lost = match.host_len if keep == 0 else sum(node.num_pages for node in dropped)
        s.tree.lock(new_last)
        s.tree.unlock(match.last_node)
        s.metrics.l2_hit_tokens -= lost * s.layout.page_size
        s.metrics.miss_tokens += lost * s.layout.page_size
        match.last_node = new_last
        match.host_nodes = match.host_nodes[:keep]
        match.host_len -= lost

    def recomputed(self, load: LoadOp) -> None:
        """See `HiCache.recomputed`."""
        if load.state is not LoadState.ABORTED:
            raise ValueError(f"load {load.id} is {load.state.value}, not aborted: nothing to recompute")
        for node in load.nodes:
            if node.stale_load is load:
                if node.lock_ref == 0:
                    raise ValueError(f"{node}: recomputed() after the request released it")
                node.stale_load = None
                self.s.tree.refresh_family(node)

    # ---- backup ------------------------------------------------------------------------

    def reserve_backup(self, device_pages: np.ndarray, first_position: int) -> BackupOp | None:
        """See `HiCache.reserve_backup`."""
        s = self.s
        if s.config.write_policy is not WritePolicy.WRITE_THROUGH or len(device_pages) == 0:
            return None
        host = self.evictor.reserve_host(len(device_pages), first_position)
        if host is None:
            return None
        device_pages = np.asarray(device_pages, np.int64)
        op = BackupOp(s.layout, device_pages, host, first_position,
                      self._local_pages(device_pages, first_position, backup=True), s.rank, layerwise=True)  # fmt: skip
        self._plan(op, Direction.D2H)  # here, once: the layer hooks then do no per-page work
        s.backups.append(op)
        s.metrics.backups_started += 1
        return op

    def on_layers_end(self, model: Model, layers: range, backups: Iterable[BackupOp | None]) -> None:
        """See `HiCache.on_layers_end`."""
        # The hot path: per op, a lookup of the parts due at each layer and one engine
        # call for all of them (the op's plan was made at reservation).
        for op in backups:
            if op is None:
                continue
            state = op.state
            if state is not _RESERVED and state is not _WRITING:
                continue
            if not op.layerwise:
                raise ValueError(f"backup {op.id} is an all-layer backup; layer hooks drive reservations only")
            if len(layers) == 1:
                layer = layers[0]
                parts = op.layers_to_submit(model, layer)
                if not parts:
                    continue
                op.record_layer(parts, layer, self._submit_layer(op, Direction.D2H, parts, layer))
            else:
                jobs = [(parts, layer) for layer in layers if (parts := op.layers_to_submit(model, layer))]
                if not jobs:
                    continue
                op.record_layers(jobs, self._submit_layers(op, Direction.D2H, jobs))
            if op.state is _RESERVED:
                op.transition(_WRITING)

    def start_backup(self, node: Node) -> BackupOp | None:
        """See `HiCache.start_backup`."""
        s = self.s
        if not node.on_device or node.host_state is not HostState.NONE or node.load is not None:
            raise ValueError(f"{node} cannot be backed up (needs device pages and no host copy)")
        if node.stale_load is not None:
            raise ValueError(f"{node} cannot be backed up: its L1 pages are awaiting recompute after an aborted load")
        host = self.evictor.reserve_host(node.num_pages, node.first_position)
        if host is None:
            return None
        pages: np.ndarray = node.device_pages  # type: ignore[assignment]
        local = self._local_pages(pages, node.first_position, backup=True)
        op = BackupOp(s.layout, pages, host, node.first_position, local, s.rank, layerwise=False)
        op.after, _ = prefix_loads(node)  # a stale node is refused above; so is its subtree
        if self.verifying:
            op.tags = self.identity(path_tokens(node), node.first_position, node.end_position)
        self.attach(op, node)
        s.backups.append(op)
        s.metrics.backups_started += 1
        s.metrics.backups_all_layer += 1
        if s.metrics.backups_all_layer % _ALL_LAYER_WARN_EVERY == 1:
            logger.warning(
                "rank %d: all-layer backup path in use (%s, %d so far): copies are not overlapped with the forward",
                s.rank,
                s.config.write_policy.value,
                s.metrics.backups_all_layer,
            )
        self._submit_all_layers(op, Direction.D2H)
        op.transition(BackupState.WRITING)
        return op

    def abort_backup(self, op: BackupOp) -> None:
        """See `HiCache.abort_backup`."""
        if op.state in (BackupState.RESERVED, BackupState.WRITING):
            op.transition(BackupState.FAILING)

    def attach(self, op: BackupOp, node: Node, host_pages: np.ndarray | None = None) -> None:
        """The node's host copy is `op`'s reservation (or its run `host_pages` of
        it), PENDING until it commits."""
        node.host_pages = op.host_pages if host_pages is None else host_pages
        node.host_state = HostState.PENDING
        node.backup = op
        op.nodes.append(node)
        self.s.tree.refresh_family(node)

    def claim(self, op: BackupOp, runs: list[tuple[Node, int]]) -> None:
        """Attach a write-through backup at insert to the nodes that took its pages.

        `runs` are (node, offset): the node holds the op's device pages
        [offset, offset + node.num_pages) and has no host copy; it gets the
        matching host pages, PENDING until the op commits. The op's other host
        pages (positions the tree already held otherwise) become spare: the
        copies in flight still write them, so they are freed at the decision.
        With no run at all the op is aborted (`error` says why). Decided on
        replicated state (the tree), so every CP rank trims alike. O(pages).
        """
        s = self.s
        assert op.state in (_RESERVED, _WRITING) and not op.nodes, f"backup {op.id} ({op.state.value}) claimed twice"
        if not runs:
            op.error = op.error or RuntimeError(
                f"positions {op.first_position}..{op.first_position + op.num_pages} were all in the tree already, "
                "with a host copy or held by a request"
            )
            self.abort_backup(op)
            return
        taken = np.zeros(op.num_pages, dtype=bool)
        for node, lo in runs:
            hi = lo + node.num_pages
            assert 0 <= lo and hi <= op.num_pages and not taken[lo:hi].any(), (
                f"rank {s.rank}: backup {op.id}: {node} at offset {lo} overlaps another run or lies outside "
                f"its {op.num_pages} pages"
            )
            assert node.host_state is HostState.NONE and node.device_pages is not None and np.array_equal(
                node.device_pages, op.device_pages[lo:hi]
            ), f"rank {s.rank}: backup {op.id}: {node} does not hold the L1 pages it copies at offset {lo}"
            taken[lo:hi] = True
            self.attach(op, node, op.host_pages[lo:hi])
        if not taken.all():
            op.spare_host_pages = op.host_pages[~taken]
            s.metrics.backup_pages_trimmed += len(op.spare_host_pages)
            logger.debug(
                "rank %d: backup %d trimmed to %d of %d pages (the rest were in the tree already)",
                s.rank, op.id, op.num_pages - len(op.spare_host_pages), op.num_pages,
            )

    # ---- decisions -----------------------------------------------------------------------

    def poll(self) -> None:
        """See `HiCache.poll`."""
        s = self.s
        ops: list[BackupOp | LoadOp] = [*s.backups, *s.loads]
        l3_ops = s.l3.poll_ops() if s.l3 is not None else []  # L3 prefetches and write-backs vote too
        if not ops and not l3_ops:
            return
        # A backup's vote says landed only once its checksums are stored (`io.verify`):
        # in the node tier's shared table too, before any rank may load the copy.
        votes = s.agreement.reduce([op.local_vote() for op in [*ops, *l3_ops]])
        self._record_copy_latencies(ops)
        decisions = list(zip(ops, votes))
        # Loads first: an aborted load fails the backups computed on top of it
        # (`BackupOp.after`) in the same poll.
        for op, vote in decisions:
            if isinstance(op, LoadOp):
                self._decide_load(op, vote)
        for op, vote in decisions:
            if isinstance(op, BackupOp):
                failing = op.state is BackupState.FAILING
                self._decide_backup(op, vote.ok and not failing, vote.settled)
        s.backups = [op for op in s.backups if op.active]
        s.loads = [op for op in s.loads if op.active]
        if s.l3 is not None:
            s.l3.decide(list(zip(l3_ops, votes[len(ops) :])))

    def _record_copy_latencies(self, ops: list[BackupOp | LoadOp]) -> None:
        m = self.s.metrics
        for op in ops:
            hist = m.copy_latency_d2h if isinstance(op, BackupOp) else m.copy_latency_h2d
            for seconds in op.copy_latencies:
                hist.observe(seconds)
            op.copy_latencies.clear()

    def settle(self) -> None:
        """See `HiCache.settle`."""
        if self.s.l3 is not None:
            self.s.l3.wait_inflight()  # prefetch reads, each up to its deadline
        for op in [*self.s.backups, *self.s.loads]:
            for t in op.inflight:
                try:
                    t.wait()
                except Exception:  # recorded in the op's vote
                    pass
        self.poll()

    def drain(self, timeout_polls: int) -> None:
        """See `HiCache.drain`."""
        s = self.s
        for _ in range(timeout_polls):
            l3_busy = s.l3 is not None and s.l3.busy
            if not s.backups and not s.loads and not l3_busy:
                return  # L3 write-backs too: counters read after a drain are final
            if l3_busy and not s.backups and not s.loads:
                time.sleep(0.001)  # only store calls left, on the client's threads
            self.settle()
            if any(op.nodes == [] and op.state is not BackupState.FAILING for op in s.backups):
                break  # unattached backups wait for their insert
        if s.loads or any(op.nodes for op in s.backups):
            unsubmitted = {op.id: op.missing_layers() for op in s.backups if op.missing_layers()}
            raise RuntimeError(
                f"rank {s.rank}: ops still in flight after drain: {s.backups + s.loads}; "
                f"layers never submitted by a layer hook: {unsubmitted}"
            )

    def _decide_backup(self, op: BackupOp, ok: bool, settled: bool) -> None:
        s = self.s
        if ok and any(load.state is LoadState.ABORTED for load in op.after):
            op.error = op.error or RuntimeError("a load of the prefix these pages were computed on aborted")
            ok = False
        if ok and settled:
            if not op.nodes:  # forward done but `insert` not called yet
                return
            if any(load.active for load in op.after):
                return  # the prefix is still loading: its outcome decides this copy's
            op.transition(BackupState.COMMITTED)
            if op.tags is not None:
                s.host_pool.set_tags(op.host_pages, op.tags)  # spare pages too: freed below, which clears them
            for node in op.nodes:
                s.commit_host_copy(node)  # visible now, and announced (never before this)
            if s.node is not None:
                s.node.on_committed(op.nodes)  # journaled now that every rank's copy landed
            if len(op.spare_host_pages):  # trimmed at insert: no copy writes them any more
                s.free_host_pages(op.spare_host_pages)
                op.spare_host_pages = op.spare_host_pages[:0]
            s.metrics.backups_committed += 1
            s.metrics.bytes_d2h += op.nbytes
            s.metrics.backup_commit_latency.observe(time.perf_counter() - op.created_at)
            if s.l3 is not None:
                s.l3.on_committed(op.nodes)  # queue the write-back to L3
            logger.debug("rank %d: backup %d committed (%d pages)", s.rank, op.id, op.num_pages)
        elif not ok:
            if op.state is not BackupState.FAILING:
                op.transition(BackupState.FAILING)
            if settled:
                self._abort_backup_now(op)

    def _abort_backup_now(self, op: BackupOp) -> None:
        s = self.s
        op.transition(BackupState.ABORTED)
        for node in op.nodes:
            node.host_pages = None
            node.host_state = HostState.NONE
            node.host_parts = frozenset()
            node.backup = None
            s.tree.refresh_family(node)
        s.free_host_pages(op.host_pages)  # the nodes' runs and the spare pages
        op.spare_host_pages = op.spare_host_pages[:0]
        s.metrics.backups_aborted += 1
        s.metrics.backup_pages_dropped += sum(node.num_pages for node in op.nodes)
        logger.warning("rank %d: backup %d aborted, %d host pages released: %s", s.rank, op.id, op.num_pages, op.error)
        for node in list(op.nodes):
            s.tree.prune(node)

    def _decide_load(self, op: LoadOp, vote: Vote) -> None:
        s = self.s
        ok, settled = vote.ok, vote.settled
        if ok and settled:
            op.transition(LoadState.DONE)
            for node in op.nodes:
                node.load = None
                s.tree.refresh_family(node)
            s.metrics.loads_done += 1
            s.metrics.bytes_h2d += op.nbytes
            s.metrics.load_done_latency.observe(time.perf_counter() - op.created_at)
            if s.node is not None:  # adopted pages passed their first check
                s.node.on_loaded(op.host_pages)
            if s.config.l2_exclusive:
                self.evictor.note_loaded(op.nodes)
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
                    s.tree.refresh_family(node)
                self._mark_stale_below(op)  # their backups fail through `BackupOp.after`
                tokens = op.num_pages * s.layout.page_size
                s.metrics.l2_hit_tokens -= tokens
                s.metrics.miss_tokens += tokens
                s.metrics.loads_aborted += 1
                logger.warning(
                    "rank %d: load %d (request %s) aborted, its %d L1 pages must be recomputed: %s",
                    s.rank, op.id, op.request, op.num_pages, op.error or "failed on another rank",
                )
                if not vote.intact:  # a restore check failed on some rank: the copy is bad everywhere
                    why = f"load {op.id}: {op.error or 'a check failed on another rank'}"
                    self.evictor.drop_host_copy(op.sources, op.host_pages, why)

    def _mark_stale_below(self, load: LoadOp) -> None:
        """Mark the L1 nodes under an aborted load's nodes stale: a forward that
        waited on the load may have computed them from invalid KV. (Some were
        loaded from a valid host copy instead; treating them as misses too
        keeps the rule simple, and loads rarely abort.)"""
        if not load.nodes:  # a load into engine-owned pages (`load_into`): nothing in the tree
            return
        top = min(load.nodes, key=lambda n: n.first_position)
        own = set(map(id, load.nodes))
        stack = list(top.children.values())
        while stack:
            node = stack.pop()
            if node.on_device and node.load is None and id(node) not in own:  # loading: bytes from L2, valid
                node.stale_load = load
            stack.extend(node.children.values())

    # ---- io ----------------------------------------------------------------------------

    def _submit_all_layers(self, op: BackupOp | LoadOp, direction: Direction) -> None:
        """Submit every layer of every part, in forward order (the all-layer paths)."""
        jobs = op.all_layers()
        op.record_layers(jobs, self._submit_layers(op, direction, jobs))

    def _local_pages(self, device_pages: np.ndarray, first_position: int = 0, *, backup: bool = False) -> int:
        """How many of these logical pages this rank owns (and copies): of a backup into
        the node's one copy, its share (`NodeTier.share`)."""
        share = self.s.node.share(first_position, len(device_pages)) if backup and self.s.node is not None else None
        if share is not None:
            return share[1] - share[0]
        if self.s.cp_size == 1:
            return len(device_pages)
        return int(cp_mapping.owned_mask(device_pages, self.s.rank, self.s.cp_size).sum())

    def _physical(self, op: BackupOp | LoadOp) -> tuple[np.ndarray, np.ndarray]:
        """The physical ids of the pages of `op` this rank owns (device, host)."""
        s = self.s
        dev, host = op.device_pages, op.host_pages
        share = s.node.share(op.first_position, op.num_pages) if s.node is not None and isinstance(op, BackupOp) else None
        if share is not None:
            return dev[share[0] : share[1]], host[share[0] : share[1]]
        if s.cp_size == 1:
            return dev, host
        mine = cp_mapping.owned_mask(dev, s.rank, s.cp_size)
        return cp_mapping.to_physical(dev[mine], s.cp_size), cp_mapping.to_physical(host[mine], s.cp_size)

    def _plan(self, op: BackupOp | LoadOp, direction: Direction) -> CopyPlan:
        """The engine's plan of this rank's pages of `op` (`CopyEngine.plan`), made once;
        a load's carries the pages its checks cover (`_checked_rows`)."""
        if op.plan is None:
            if op.physical is None:
                op.physical = self._physical(op)
            plan = self.s.engine.plan(direction, *op.physical)
            plan.request = op.request
            if direction is Direction.H2D:
                plan.check = self._checked_rows(op, plan.num_pages)
            op.plan = plan
        return op.plan

    def _checked_rows(self, op: BackupOp | LoadOp, n: int) -> np.ndarray | None:
        """Which of the `n` pages this rank loads for `op` its checks cover: those
        `verify_restores` picks (`checksum.sample_positions`; None: all) and, with the
        node tier, every adopted page no load has checked yet: an adopted copy's first
        use is always checked. O(n)."""
        s = self.s
        rows = sample_positions(n, op.id, s.config.verify_restores)
        if rows is None or s.node is None or s.config.verify_restores is Verify.OFF:
            return rows
        host = op.host_pages
        if s.cp_size > 1:  # this rank's rows: the pages it owns, in op order (`_physical`)
            host = host[cp_mapping.owned_mask(op.device_pages, s.rank, s.cp_size)]
        first = np.flatnonzero(s.node.first_use(host))
        return np.union1d(rows, first) if len(first) else rows

    def _submit_layer(
        self, op: BackupOp | LoadOp, direction: Direction, parts: tuple[Part, ...], layer: int
    ) -> list[CopyTicket | None]:
        """This rank's share of one layer of `parts` in one engine call; per part its
        ticket (None where this rank owns no page of the op)."""
        plan = op.plan if op.plan is not None else self._plan(op, direction)
        return self.s.engine.submit_layer(plan, parts, layer)

    def _submit_layers(
        self, op: BackupOp | LoadOp, direction: Direction, jobs: list[tuple[tuple[Part, ...], int]]
    ) -> list[list[CopyTicket | None]]:
        """Every (parts, layer) of `jobs` in one engine call; per layer and part its
        ticket (None where this rank owns no page of the op)."""
        plan = op.plan if op.plan is not None else self._plan(op, direction)
        return self.s.engine.submit_layers(plan, jobs)


def path_tokens(node: Node) -> np.ndarray:
    """The tokens of every page from the root to the end of `node`. O(depth + tokens)."""
    chain: list[np.ndarray] = []
    n: Node | None = node
    while n is not None and n.parent is not None:
        chain.append(n.tokens)
        n = n.parent
    return np.concatenate(chain[::-1]) if chain else np.empty(0, np.int64)


def prefix_loads(node: Node) -> tuple[list[LoadOp], bool]:
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
