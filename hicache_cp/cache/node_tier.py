"""The node tier inside one cache: L2 in the node's shared segment, kept across restarts.

Built by `HiCache` when `config.node_segment` names a segment
(docs/node-tier.md). One rank's part of it:

    open        NodeSegment: join this engine's segment, adopt a previous
                engine's, or start clean (`hicache_cp.node.segment`)
    host pool   this rank's copy's regions of the segment become the L2 arenas,
                and its checksum table the checksum arena (prefaulted keeping
                their contents, registered with CUDA by the arenas' own pipeline)
    adopt       a journal that survived is rebuilt into committed host-only
                nodes (`hicache_cp.node.adopt`) with their identity tags
                (`HostPool.tags`, from the journal's tokens); every rank builds
                the same tree, then MIN agreements check they did
    share       replicated pools: a backup's pages are cut into one slice per
                rank and each rank copies only its own (`write_share`); loads
                read every page
    journal     the agreed commit records the op's nodes, and a page leaving L2
                is released, both by the journal's writer (rank 0) before the
                allocator may reuse the page
    first use   an adopted page is always checked by the load that first reads
                it, whatever `verify_restores` samples (`first_use`), and counts
                as verified once that load is agreed done (`on_loaded`)

Checksums are the restore checks' own (`hicache_cp.checksum`,
docs/integrity.md): the segment holds each copy's checksum table, which is
that copy's `HostPool.sums`, so the rank that copies a slice stores its
checksums where every rank's load compares against them, and a failed check
takes the copy out of L2 (and the journal) on every rank through
`Evictor.drop_host_copy`, like any failed restore.

No cross-process lock is taken after opening: the tree and the allocator
are replicated (every rank makes the same decisions at the same step),
the journal has one writer, and each byte of a copy has one writer at a
time (the rank whose share it is), between an agreed reservation and an
agreed decision (docs/node-tier.md, "The protocol").
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hicache_cp.checksum import Verify
from hicache_cp.config import Config
from hicache_cp.cp.agreement import Agreement
from hicache_cp.errors import ConsistencyError
from hicache_cp.keys import chain_hashes, prefix_hashes
from hicache_cp.layout import KVLayout
from hicache_cp.node.adopt import Adoption, adopt
from hicache_cp.node.geometry import NodeGeometry, Sharing
from hicache_cp.node.journal import ROOT, Journal
from hicache_cp.node.segment import NodeSegment
from hicache_cp.node.share import write_share
from hicache_cp.pools import HostPool
from hicache_cp.radix import HostState, Node, RadixTree

logger = logging.getLogger(__name__)


def sharing_of(config: Config) -> Sharing:
    """`config.node_sharing` made concrete: replicated at cp_size 1 (TP replicas), per rank under CP."""
    sharing = Sharing(config.node_sharing)
    if sharing is Sharing.AUTO:
        return Sharing.REPLICATED if config.cp_size == 1 else Sharing.PER_RANK
    return sharing


def node_budget(config: Config, budget_bytes: int, world: int) -> int:
    """One copy's pool: the rank budget `budget_bytes` (`build.host_budget`); with
    "auto" and one copy for the node (replicated), what its `world` ranks would
    have had together."""
    if config.host_budget_bytes == "auto" and sharing_of(config) is Sharing.REPLICATED:
        return budget_bytes * world
    return budget_bytes


def node_geometry(config: Config, layout: KVLayout, budget_bytes: int, world: int) -> NodeGeometry:
    """The segment `config` asks for: one copy of a pool of `budget_bytes` per rank
    (replicated: one for the node), the model named by `node_model_id` or `model`."""
    sharing = sharing_of(config)
    checked = config.verify_restores is not Verify.OFF  # a checksum table for each copy
    return NodeGeometry(
        layout, config.node_model_id or config.model, layout.split_budget(budget_bytes).pages, config.cp_size,
        1 if sharing is Sharing.REPLICATED else world, sharing, config.l3.kv_dtype, checked,
    )  # fmt: skip


class NodeTier:
    """One rank's view of the node tier; see the module docstring.

    Args:
        config, layout: the cache's.
        agreement: the ranks of the node (TP replicas, or the CP group).
        budget_bytes: one copy's pool, as a private pool would have.
        rank: this rank's CP rank (its copy under CP).
        session: the engine's session number; default: agreed over `agreement`.
        writer: whether this process keeps the journal; default: agreement rank 0.
    """

    def __init__(self, config: Config, layout: KVLayout, agreement: Agreement, budget_bytes: int, *, rank: int = 0,
                 session: int | None = None, writer: bool | None = None) -> None:  # fmt: skip
        self.config = config
        self.layout = layout
        self.agreement = agreement
        self.world = agreement.world_size
        self.node_rank = agreement.rank
        self.geometry = node_geometry(config, layout, budget_bytes, self.world)
        self.sharing = self.geometry.sharing
        self.copy = 0 if self.sharing is Sharing.REPLICATED else (rank if config.cp_size > 1 else self.node_rank)
        self.cp_rank = rank
        if session is None:
            session = agreement.min_int(random.SystemRandom().getrandbits(62))
        t0 = time.perf_counter()
        # Without checksums nothing adopted could be checked before its first use: never adopt then.
        self.segment = NodeSegment(config.node_segment, self.geometry, session=session,
                                   adopt=config.node_adopt and self.geometry.verify, numa_policy=config.node_numa,
                                   directory=Path(config.node_segment_dir) if config.node_segment_dir else None)  # fmt: skip
        self.journal = Journal(self.segment, writer=self.node_rank == 0 if writer is None else writer)
        self.open_s = time.perf_counter() - t0
        self.adoption = Adoption()
        self.adopt_s = 0.0
        #: Adopted pages no load has checked yet: their first use is checked whatever is sampled.
        self.unverified = np.zeros(self.geometry.logical_pages, dtype=bool)
        self.verified_pages = 0  # adopted pages checked by their first load
        self.verify_failures = 0  # adopted copies dropped by a failed check before any load of them passed

    # -- construction -------------------------------------------------------------

    def host_pool(self, pin: bool | None) -> HostPool:
        """This rank's L2: its copy's regions of the segment, and its checksum table
        (with `verify_restores` on), through the arenas."""
        g = self.geometry
        regions = {p.part: self.segment.region(self.copy, p.part) for p in self.layout.parts}
        return HostPool(self.layout, g.physical_pages * self.layout.bytes_per_page, cp_size=self.config.cp_size,
                        rank=self.cp_rank, pin=pin, regions=regions,
                        sums_region=self.segment.sums_region(self.copy) if g.verify else None)  # fmt: skip

    def adopt(self, tree: RadixTree, host_pool: HostPool) -> Adoption:
        """Rebuild the tree from the journal (every rank alike) with the adopted copies'
        identity tags, then agree that every rank adopted the same pages and tags.

        Raises ConsistencyError when ranks disagree."""
        t0 = time.perf_counter()
        parts = frozenset(p.part for p in self.layout.parts)
        self.adoption = adopt(self.journal.committed(), tree, host_pool.allocator, parts)
        digest = self._tag(host_pool) if self.geometry.verify else 0
        n = self.adoption.pages
        for what, mine in (("pages", n), ("identity tags", digest)):
            low, high = self.agreement.min_int(mine), -self.agreement.min_int(-mine)
            if low != mine or high != mine:
                raise ConsistencyError(
                    f"node ranks adopted different journals ({what})", rank=self.node_rank,
                    details={what: mine, "min": low, "max": high, "segment": self.segment.path},
                )  # fmt: skip
        if self.journal.writer and len(self.adoption.dropped):
            self.journal.release(self.adoption.dropped)
        for node in self.adoption.nodes:
            self.unverified[node.host_pages] = True
        self.adopt_s = time.perf_counter() - t0
        if n or len(self.adoption.dropped):
            logger.info("node segment %s: adopted %d pages in %d nodes in %.3f s (%d entries dropped: %d damaged, "
                        "%d orphans)", self.segment.path, n, len(self.adoption.nodes), self.adopt_s,
                        len(self.adoption.dropped), self.adoption.damaged, self.adoption.orphans)  # fmt: skip
        return self.adoption

    def _tag(self, host_pool: HostPool) -> int:
        """Record the identity tag (prefix hash, `hicache_cp.keys.prefix_hashes`) of every
        adopted page, chained from its parent's last page as the restore checks compute
        it from a request's tokens; return a 62-bit digest of them for the agreement.
        Parents come before their children in `adoption.nodes`. O(adopted tokens)."""
        tags = host_pool.tags
        digest = np.uint64(0)
        for node in self.adoption.nodes:
            parent = node.parent
            before = int(tags[parent.host_pages[-1]]) if parent is not None and parent.host_pages is not None else 0
            mine = prefix_hashes(node.tokens, self.layout.page_size, before)
            host_pool.set_tags(node.host_pages, mine)  # type: ignore[arg-type]
            digest ^= np.bitwise_xor.reduce(mine ^ node.host_pages.astype(np.uint64))  # type: ignore[union-attr]
        return int(digest >> np.uint64(2))

    @property
    def private_copy(self) -> bool:
        return self.sharing is not Sharing.REPLICATED

    def check_invariants(self, kept: np.ndarray) -> None:
        """The journal names only pages of committed copies (or pages the L3 tier still
        holds, unchanged since their commit): any other page may be free, pending or
        rewritten, and a restart would adopt it. Checked by the writer (the other ranks'
        view of the journal runs ahead or behind their own steps). O(directory)."""
        if not self.journal.writer:
            return
        stray = np.setdiff1d(self.journal.committed_pages(), kept)
        assert not len(stray), f"node segment {self.segment.path}: journal entries for pages not committed: {stray[:16]}"

    # -- the write share -------------------------------------------------------------

    def share(self, first_position: int, num_pages: int) -> tuple[int, int] | None:
        """`[lo, hi)` of a backup's pages this rank copies into a replicated pool;
        None for per-rank copies (each rank copies what it owns, as without the tier)."""
        if self.sharing is not Sharing.REPLICATED:
            return None
        return write_share(first_position, num_pages, self.node_rank, self.world)

    # -- hooks of the cache -------------------------------------------------------------

    def on_committed(self, nodes: Sequence[Node]) -> None:
        """A backup committed `nodes`: the writer journals them, parents first."""
        if not self.journal.writer:
            return
        for node in sorted(nodes, key=lambda n: n.first_position):
            assert node.host_pages is not None
            self.journal.commit(node.host_pages, node.first_position, node.tokens, self._key_before(node))

    def on_free(self, pages: np.ndarray, failed: bool = False) -> None:
        """`pages` leave L2 (before the allocator may reuse them); `failed`: a copy
        dropped after a failed check (counted when it was adopted and never checked)."""
        if self.journal.writer:
            self.journal.release(pages)
        pages = np.asarray(pages, np.int64)
        if failed and self.unverified[pages].any():
            self.verify_failures += 1  # (the drop logs the WARNING)
        self.unverified[pages] = False

    def first_use(self, pages: np.ndarray) -> np.ndarray:
        """Which logical `pages` (a load's) are adopted and not checked yet: bool, aligned. O(n)."""
        return self.unverified[np.asarray(pages, np.int64)]

    def on_loaded(self, pages: np.ndarray) -> None:
        """A load of `pages` was agreed done: every page it read passed its check. O(n)."""
        pages = np.asarray(pages, np.int64)
        self.verified_pages += int(np.count_nonzero(self.unverified[pages]))
        self.unverified[pages] = False

    def clear(self) -> None:
        """A reset: the journal forgets every copy (its writer), so that no later engine
        adopts what this one's cache held. O(directory)."""
        if self.journal.writer:
            self.journal.clear()
        self.unverified[:] = False

    def _key_before(self, node: Node) -> bytes:
        """The chain hash of the prefix before `node`: its parent's journal entry when the
        parent's last page is journaled, else hashed from the root path's tokens."""
        parent = node.parent
        if parent is None or parent.parent is None:
            return ROOT
        if parent.host_state is HostState.COMMITTED and parent.host_pages is not None:
            key = self.journal.key_of(int(parent.host_pages[-1]), parent.end_position - 1)
            if key is not None:
                return key
        path: list[np.ndarray] = []
        n: Node | None = parent
        while n is not None and n.parent is not None:
            path.append(n.tokens)
            n = n.parent
        return chain_hashes(np.concatenate(path[::-1]), self.layout.page_size)[-1]

    # -- reports and teardown ------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        g = self.geometry
        return {
            "node_segment": self.segment.path,
            "node_decision": self.segment.decision.value,  # this rank's: join, adopt or clean
            "node_adopted": self.segment.adopted,  # the session's: a previous engine's journal kept
            "node_sharing": self.sharing.value,
            "node_segment_bytes": g.total_bytes,
            "node_copy_bytes": g.copy_bytes,
            "node_copies": g.copies,
            "node_ranks": self.world,
            "node_adopted_pages": self.adoption.pages,
            "node_adopted_nodes": len(self.adoption.nodes),
            "node_dropped_entries": len(self.adoption.dropped),
            "node_open_s": round(self.open_s, 6),
            "node_adopt_s": round(self.adopt_s, 6),
            "node_verified_pages": self.verified_pages,
            "node_verify_failures": self.verify_failures,
            "node_journal_commits": self.journal.commits,
            "node_journal_releases": self.journal.releases,
        }

    def close(self) -> bool:
        """Unmap (after the host pool closed); drop the segment if configured and last."""
        return self.segment.close(drop=self.config.node_drop_on_close)

