"""Engine-owned L1: the cache as the host tier of an engine that manages its device pages.

An engine such as vLLM allocates, shares and frees its device KV blocks
itself and keeps its own prefix index over them. Then the cache's tree holds
host copies only: no node ever has device pages, `match_prefix` returns an
empty device prefix and the committed L2 path, and the engine's block ids
appear only inside the copy ops. The protocol of one request:

    m = cache.match_prefix(tokens)                 # committed L2 path, locked
    load = cache.load_into(m, blocks, first)       # H2D of some of its pages into the engine's blocks
    ...                                            # keep m locked until `load` is decided (poll)
    ops = cache.reserve_host_copy(tokens, blocks)  # write-through of the pages L2 lacks: PENDING nodes
    cache.on_layer_end(model, layer, ops)          # per layer, as usual
    cache.poll()                                   # commits (visible), aborts (released)
    cache.release(m.last_node)

Visibility, all-or-nothing and eviction are the cache's usual rules: a copy
from `reserve_host_copy` is PENDING (invisible to `match_prefix`, not
evictable) until every layer of every part landed. A load is not attached to
tree nodes (the engine owns the device pages); the caller's lock on the
match keeps its source pages from eviction, and its failure marks nothing
stale: the engine recomputes those blocks (vLLM: its load-error path), and
every backup reserved with `after=[load]` fails with it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from hicache_cp.cache.lifecycle import Lifecycle
from hicache_cp.match import MatchResult
from hicache_cp.cache.state import CacheState
from hicache_cp.errors import ConsistencyError
from hicache_cp.io.base import CopyFailed, Direction
from hicache_cp.ops import BackupOp, LoadOp, LoadState
from hicache_cp.radix import Node, whole_pages

logger = logging.getLogger(__name__)


class EngineL1:
    """`load_into` and `reserve_host_copy` over the shared state (see the module docstring)."""

    def __init__(self, state: CacheState, lifecycle: Lifecycle) -> None:
        self.s = state
        self.lifecycle = lifecycle
        self._tags: np.ndarray | None = None  # identity tags of the request `reserve_host_copy` serves

    def load_into(self, match: MatchResult, device_pages: np.ndarray, first_position: int) -> LoadOp:
        """See `HiCache.load_into`."""
        s = self.s
        device_pages = np.asarray(device_pages, dtype=np.int64)
        n = len(device_pages)
        if match.device_len:
            raise ValueError("load_into is for engine-owned L1, but the match has a device prefix in the tree")
        if sum(node.num_pages for node in match.host_nodes) != match.host_len:
            raise ConsistencyError(
                "the host continuation was split between match_prefix and load_into",
                node=match.host_nodes[0].id,
                pages=match.host_len,
                rank=s.rank,
            )
        start = match.host_nodes[0].first_position if match.host_nodes else 0
        lo = first_position - start
        if n == 0 or lo < 0 or lo + n > match.host_len:
            raise ValueError(
                f"load_into: pages [{first_position}, {first_position + n}) are not inside the matched "
                f"host continuation [{start}, {start + match.host_len})"
            )
        if first_position < match.checked_from:
            raise ValueError(
                f"load_into: page {first_position} is below the match's checked_from ({match.checked_from}): "
                "the identity of those host copies was not checked"
            )
        host = match.host_pages[lo : lo + n]
        op = LoadOp(s.layout, device_pages, host, first_position, self.lifecycle._local_pages(device_pages), s.rank)
        op.request = match.request
        op.sources = list(match.host_nodes)  # their identity was checked by match_prefix
        try:
            self.lifecycle._submit_all_layers(op, Direction.H2D)
        except CopyFailed as exc:  # copies already submitted write into the engine's pages: let them return
            for t in [*op.inflight, *exc.submitted]:
                try:
                    t.wait()
                except Exception:  # the submission's own failure is what the caller gets
                    pass
            raise
        op.transition(LoadState.LOADING)
        s.loads.append(op)
        s.metrics.loads_started += 1
        logger.debug("rank %d: load %d into engine pages started, %d pages at %d", s.rank, op.id, n, first_position)
        return op

    def reserve_host_copy(
        self, tokens: np.ndarray, device_pages: np.ndarray, after: Sequence[LoadOp] = ()
    ) -> list[BackupOp]:
        """See `HiCache.reserve_host_copy`."""
        s = self.s
        ps = s.layout.page_size
        pages = whole_pages(tokens, ps)
        n = len(pages) // ps
        device_pages = np.asarray(device_pages, dtype=np.int64)
        if len(device_pages) != n:
            raise ValueError(f"reserve_host_copy: {len(device_pages)} device pages for {n} whole pages of tokens")
        path = s.tree.match(pages)
        if any(node.on_device for node in path):
            raise ValueError("reserve_host_copy is for engine-owned L1, but the tree holds device pages")
        self._tags = self.lifecycle.identity(pages, 0, n)
        if path:  # our own reservations must not evict the path they extend
            s.tree.lock(path[-1])
        ops: list[BackupOp] = []
        try:
            for node in path:
                if node.host_pages is None:  # a gap: its copy aborted or was evicted below a child's
                    op = self._reserve(device_pages[node.first_position : node.end_position], node, after)
                    if op is None:
                        return ops
                    ops.append(op)
            parent = path[-1] if path else s.tree.root
            covered = parent.end_position
            if covered < n:
                node = s.tree.add_child(parent, pages[covered * ps :], None)
                node.last_access = s.clock
                op = self._reserve(device_pages[covered:], node, after)
                if op is None:
                    s.tree.prune(node)
                else:
                    ops.append(op)
            return ops
        finally:
            if path:
                s.tree.unlock(path[-1])
            s.debug_check()

    def _reserve(self, device_pages: np.ndarray, node: Node, after: Sequence[LoadOp]) -> BackupOp | None:
        """A write-through reservation for `node`'s pages, attached (PENDING) at once."""
        op = self.lifecycle.reserve_backup(device_pages, node.first_position)
        if op is None:
            return None
        op.after = list(after)
        if self._tags is not None:
            op.tags = self._tags[node.first_position : node.first_position + len(device_pages)]
        self.lifecycle.attach(op, node)
        return op
