"""Prefix matching and insertion: the tree side of a request.

`match_prefix` finds the longest cached prefix (L1 pages, then the committed
L2 continuation) and locks it; `insert` adds the request's computed pages
and attaches its write-through backup. Both keep the radix tree's
invariants; neither copies bytes.
"""

from __future__ import annotations

import logging

import numpy as np

from hicache_cp.cache.lifecycle import Lifecycle, prefix_loads
from hicache_cp.match import MatchResult
from hicache_cp.cache.state import CacheState
from hicache_cp.config import WritePolicy
from hicache_cp.errors import ConsistencyError, IntegrityError
from hicache_cp.ops import BackupOp, BackupState, LoadOp
from hicache_cp.radix import HostState, Node, whole_pages

logger = logging.getLogger(__name__)


class Prefixes:
    """`match_prefix` and `insert` over the shared tree."""

    def __init__(self, state: CacheState, lifecycle: Lifecycle) -> None:
        self.s = state
        self.lifecycle = lifecycle

    def match_prefix(self, tokens: np.ndarray, count: bool = True, checked_from: int = 0) -> MatchResult:
        """See `HiCache.match_prefix`."""
        s = self.s
        s.clock += 1
        m, used = self._find(tokens, checked_from)
        for node in used:
            node.hit_count += 1
            node.last_access = s.clock
        s.policy.on_match(m.tokens, used, s.clock)
        if count:
            s.metrics.record_match(len(tokens), m.device_len, m.host_len, s.layout.page_size)
        if s.config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            for node in used:
                if node.on_device and node.host_state is HostState.NONE and node.hit_count >= s.config.write_threshold:
                    self.lifecycle.start_backup(node)
        return m

    def peek(self, tokens: np.ndarray) -> MatchResult:
        """The cached prefix of a request that is not being scheduled (a queued
        one's prefetch, `HiCache.prefetch_queued`): like `match_prefix` it may
        split a node and locks `last_node` (the caller releases it), but it
        ticks no clock and counts no hit, access or request. O(matched pages)."""
        m, _ = self._find(tokens)
        return m

    def _find(self, tokens: np.ndarray, checked_from: int = 0) -> tuple[MatchResult, list[Node]]:
        """The match of `tokens`, its last node locked, and the path it uses; the host
        copies' identity checked from page position `checked_from` on."""
        s = self.s
        pages = whole_pages(tokens, s.layout.page_size)
        path = s.tree.match(pages)
        device: list[np.ndarray] = []
        host_nodes: list[Node] = []
        waits: list[LoadOp] = []
        last = s.tree.root
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
        if host_nodes and self.lifecycle.verifying and host_nodes[-1].end_position > checked_from:
            found = self._first_stale(pages, host_nodes, checked_from)
            if found is not None:
                stop, stale = found
                node = host_nodes[stop]
                last = node.parent  # type: ignore[assignment]
                host_nodes = host_nodes[:stop]
                self._drop_stale(node, stale)
        used = path[: path.index(last) + 1] if last is not s.tree.root else []
        s.tree.lock(last)
        dev = np.concatenate(device) if device else np.empty(0, dtype=np.int64)
        n = len(pages) // s.layout.page_size
        return MatchResult(pages, n, dev, host_nodes, last, waits, checked_from=checked_from), used

    def _first_stale(self, tokens: np.ndarray, host_nodes: list[Node], start: int) -> tuple[int, np.ndarray] | None:
        """The first node of the host continuation whose L2 pages from page position
        `start` on hold another copy than the tree names (`HostPool.tags`: freed and
        reused, or dropped): its index and those pages; None when every copy checked
        is the one named. Tags are replicated: every rank decides alike. O(tokens
        checked), in numpy: one comparison for the whole continuation (its nodes'
        positions are contiguous)."""
        k = next(i for i, node in enumerate(host_nodes) if node.end_position > start)
        first = max(host_nodes[k].first_position, start)
        tags = self.lifecycle.identity(tokens, first, host_nodes[-1].end_position)
        assert tags is not None
        held: list[np.ndarray] = [node.host_pages for node in host_nodes[k:]]  # type: ignore[misc]
        held[0] = held[0][first - host_nodes[k].first_position :]
        stale = self.s.host_pool.stale_tags(held[0] if len(held) == 1 else np.concatenate(held), tags)
        if not len(stale):
            return None
        for i in range(k, len(host_nodes)):  # the node of the first stale page
            node = host_nodes[i]
            lo = node.first_position - first  # negative for a node `start` cuts
            if stale[0] < lo + node.num_pages:
                mine = stale[stale < lo + node.num_pages] - lo
                return i, node.host_pages[mine]  # type: ignore[index]
        raise AssertionError(f"stale page {stale[0]} outside the continuation of {len(tags)} pages")

    def _drop_stale(self, node: Node, stale: np.ndarray) -> None:
        """A match found `node`'s L2 copy stale: counted and dropped (its `stale` pages are
        not its own: they stay with whoever holds them); the match stops before it."""
        self.s.engine.integrity.count_failed("l2", "identity", len(stale))
        reason = IntegrityError("match: L2 pages hold another copy than the tree names (freed and reused, or dropped)",
                                tier="l2", rank=self.s.rank, pages=stale, units=len(stale))  # fmt: skip
        self.lifecycle.evictor.drop_host_copy([node], stale, reason, others=stale)

    def _check_parts(self, node: Node) -> None:
        s = self.s
        if node.host_parts != s.all_parts:
            missing = sorted(p.value for p in s.all_parts - node.host_parts)
            raise ConsistencyError(
                "committed host copy is missing parts",
                node=node.id,
                pages=node.host_pages,
                part=",".join(missing),
                rank=s.rank,
            )

    def insert(self, match: MatchResult, device_pages: np.ndarray, backup: BackupOp | None) -> Node:
        """See `HiCache.insert`."""
        s = self.s
        ps = s.layout.page_size
        start = match.matched_pages
        device_pages = np.asarray(device_pages, dtype=np.int64)
        if start + len(device_pages) > match.num_pages:
            raise ValueError(
                f"insert of {len(device_pages)} pages at position {start} exceeds the request's {match.num_pages} pages"
            )
        live = backup is not None and backup.state in (BackupState.RESERVED, BackupState.WRITING)
        if backup is not None and (backup.first_position != start or not np.array_equal(backup.device_pages, device_pages)):
            raise ValueError(
                f"backup {backup.id} copies {backup.num_pages} pages at position {backup.first_position}, not the "
                f"{len(device_pages)} pages inserted at position {start}: pass the reservation made for these pages"
            )
        s.loose_device_pages -= len(device_pages)
        path = s.tree.match(match.tokens[: (start + len(device_pages)) * ps])
        covered = path[-1].end_position if path else 0
        parent = path[-1] if path else s.tree.root
        surplus: list[np.ndarray] = []
        took: list[tuple[Node, int]] = []  # nodes now holding this request's pages, at their offset in them
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
                took.append((node, lo))
                s.tree.refresh_family(node)
            elif node.stale_load is not None:
                # stale but held: the holder recomputes into these very L1 pages, so
                # they stay; freeing them under it would be a use-after-free
                surplus.append(mine)
            elif node.on_device and live and node.host_state is HostState.NONE and node.lock_ref == 0:
                # inserted meanwhile, no host copy, held by nobody: take this request's
                # pages, whose copy is in flight, so the node gets one without a second
                # copy (the tree's pages go; nobody reads them)
                surplus.append(node.device_pages)  # type: ignore[arg-type]
                node.device_pages = mine.copy()
                took.append((node, lo))
                s.tree.refresh_family(node)
            elif node.on_device:  # inserted meanwhile by another request: keep the tree's
                surplus.append(mine)
            else:  # evicted from L1 and recomputed by this request
                node.device_pages = mine.copy()
                took.append((node, lo))
                s.tree.refresh_family(node)
                s.device_changed(node, stored=True)
        if surplus:
            s.free_device_pages(np.concatenate(surplus))
        dup = max(0, covered - start)
        new_node = parent
        rest = device_pages[dup:]
        if len(rest):
            new_node = s.tree.add_child(parent, match.tokens[covered * ps : (covered + len(rest)) * ps], rest)
            new_node.last_access = s.clock
            s.policy.on_insert(match.tokens[: new_node.end_position * ps], new_node, s.clock)
            s.device_changed(new_node, stored=True)
            took.append((new_node, dup))
        below = match.last_node  # the prefix the forward read: a load of it aborted and was not recomputed?
        while below is not None and below.stale_load is None:
            below = below.parent
        if below is not None:  # computed on invalid KV: stale for good, as at the abort (`_mark_stale_below`)
            for node, _ in took:
                node.stale_load = below.stale_load
                s.tree.refresh_family(node)
        if backup is not None:
            backup.request = match.request
            backup.tags = self.lifecycle.identity(match.tokens, start, start + len(device_pages))
            self._attach_backup(backup, new_node, took)
            # pages the tree took from this request and holds without any host copy
            s.metrics.backup_pages_dropped += sum(n.num_pages for n, _ in took if n.host_state is HostState.NONE)
        s.tree.lock(new_node)
        s.tree.unlock(match.last_node)
        match.last_node = new_node
        return new_node

    def _attach_backup(self, backup: BackupOp, last: Node, took: list[tuple[Node, int]]) -> None:
        """Attach a write-through backup to the nodes that took its pages and have
        no host copy, trimming the rest (`Lifecycle.claim`); abort it when it
        already failed or its pages sit on a stale prefix."""
        backup.after, on_stale = prefix_loads(last)
        if backup.state not in (BackupState.RESERVED, BackupState.WRITING):
            return  # failing or decided already: its pages get no copy
        if on_stale:
            backup.error = backup.error or RuntimeError("computed on a prefix whose load aborted")
            self.lifecycle.abort_backup(backup)
            return
        self.lifecycle.claim(backup, [(n, lo) for n, lo in took if n.host_state is HostState.NONE])
