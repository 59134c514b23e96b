"""The node tier inside one cache: L2 in the node's shared segment, kept across restarts.

Built by `HiCache` when `config.node_segment` names a segment
(docs/node-tier.md). One rank's part of it:

    open        NodeSegment: join this engine's segment, adopt a previous
                engine's, or start clean (`hicache_cp.node.segment`)
    host pool   this rank's copy's regions of the segment become the L2 arenas
                (prefaulted keeping their contents, registered with CUDA by
                the arenas' own pipeline)
    adopt       a journal that survived is rebuilt into committed host-only
                nodes (`hicache_cp.node.adopt`); every rank builds the same
                tree, then one MIN agreement checks they did
    share       replicated pools: a backup's pages are cut into one slice per
                rank and each rank copies only its own (`write_share`); loads
                read every page
    sums        once this rank's share of a backup landed, and before its
                vote, its checksums go into the segment (`before_vote`)
    journal     the agreed commit records the op's nodes, and a page leaving L2
                is released, both by the journal's writer (rank 0) before the
                allocator may reuse the page
    first use   an adopted page is checked against its checksums the first
                time a match would load it (each rank its share, one MIN
                agreement); a bad one is dropped and the match ends before it

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hicache_cp.config import Config
from hicache_cp.cp import mapping as cp_mapping
from hicache_cp.cp.agreement import Agreement
from hicache_cp.keys import chain_hashes
from hicache_cp.layout import KVLayout, Part
from hicache_cp.match import MatchResult
from hicache_cp.node.adopt import Adoption, adopt
from hicache_cp.node.checksums import unit_sums
from hicache_cp.node.geometry import NodeGeometry, Sharing
from hicache_cp.node.journal import ROOT, Journal
from hicache_cp.node.segment import NodeSegment
from hicache_cp.node.share import write_share
from hicache_cp.ops import BackupOp
from hicache_cp.pools import HostPool
from hicache_cp.radix import HostState, Node

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
    return NodeGeometry(
        layout, config.node_model_id or config.model, layout.split_budget(budget_bytes).pages, config.cp_size,
        1 if sharing is Sharing.REPLICATED else world, sharing, config.l3.kv_dtype, config.node_verify,
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
                                   adopt=config.node_adopt and config.node_verify, numa_policy=config.node_numa,
                                   directory=Path(config.node_segment_dir) if config.node_segment_dir else None)  # fmt: skip
        self.journal = Journal(self.segment, writer=self.node_rank == 0 if writer is None else writer)
        self.open_s = time.perf_counter() - t0
        self.adoption = Adoption()
        self.adopt_s = 0.0
        self.unverified = np.zeros(self.geometry.logical_pages, dtype=bool)
        self.verified_pages = 0
        self.verify_failures = 0
        self._summed: set[int] = set()  # backup ids whose share's checksums are recorded
        self._copy_views: dict[Part, np.ndarray] | None = None
        self.drop_copy: Callable[[Node], None] = lambda node: None  # set by the cache: the L2 eviction of one node

    # -- construction -------------------------------------------------------------

    def host_pool(self, pin: bool | None) -> HostPool:
        """This rank's L2: its copy's regions of the segment, through the arenas."""
        g = self.geometry
        regions = {p.part: self.segment.region(self.copy, p.part) for p in self.layout.parts}
        return HostPool(self.layout, g.physical_pages * self.layout.bytes_per_page, cp_size=self.config.cp_size,
                        rank=self.cp_rank, pin=pin, regions=regions)  # fmt: skip

    def adopt(self, tree: Any, allocator: Any, parts: frozenset) -> Adoption:
        """Rebuild the tree from the journal (every rank alike), then agree that every rank did.

        Raises ConsistencyError when ranks adopted different page counts."""
        from hicache_cp.errors import ConsistencyError

        t0 = time.perf_counter()
        entries = self.journal.committed()
        self.adoption = adopt(entries, tree, allocator, parts)
        n = self.adoption.pages
        low, neg_high = self.agreement.min_int(n), -self.agreement.min_int(-n)
        if low != n or neg_high != n:
            raise ConsistencyError("node ranks adopted different journals", rank=self.node_rank,
                                   details={"pages": n, "min": low, "max": neg_high, "segment": self.segment.path})  # fmt: skip
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

    def _views(self) -> dict[Part, np.ndarray]:
        """This rank's copy in the segment: part -> uint8 [slots, physical_pages, page_bytes]
        (read by the checksums; a process without a host pool, vLLM's scheduler, reads them too)."""
        if self._copy_views is None:
            g, mm = self.geometry, self.segment.segment.mm
            assert mm is not None, "views of a closed node segment"
            self._copy_views = {
                p.part: np.frombuffer(mm, np.uint8, g.part_bytes(p.part), g.part_offset(self.copy, p.part)).reshape(
                    p.num_slots, g.physical_pages, p.page_bytes)
                for p in self.layout.parts
            }  # fmt: skip
        return self._copy_views

    # -- the write share -------------------------------------------------------------

    def share(self, first_position: int, num_pages: int) -> tuple[int, int] | None:
        """`[lo, hi)` of a backup's pages this rank copies into a replicated pool;
        None for per-rank copies (each rank copies what it owns, as without the tier)."""
        if self.sharing is not Sharing.REPLICATED:
            return None
        return write_share(first_position, num_pages, self.node_rank, self.world)

    def _written(self, op: BackupOp) -> tuple[np.ndarray, np.ndarray]:
        """(logical, physical) host pages of `op` this rank wrote into its copy."""
        host = op.host_pages
        share = self.share(op.first_position, op.num_pages)
        if share is not None:
            return host[share[0] : share[1]], host[share[0] : share[1]]
        if self.config.cp_size == 1:
            return host, host
        mine = cp_mapping.owned_mask(op.device_pages, self.cp_rank, self.config.cp_size)
        return host[mine], cp_mapping.to_physical(host[mine], self.config.cp_size)

    # -- hooks of the cache -------------------------------------------------------------

    def before_vote(self, landed: Sequence[BackupOp], active: Sequence[BackupOp]) -> None:
        """Record the checksums of this rank's share of each backup in `landed` (every
        layer of its share landed, no failure) before the rank votes so. O(bytes)."""
        if not self.config.node_verify:
            return
        for op in landed:
            if op.id in self._summed:
                continue
            logical, physical = self._written(op)
            if len(logical):
                self.journal.record_sums(self.copy, logical, unit_sums(self.layout, self._views(), physical))
            self._summed.add(op.id)
        if len(self._summed) > 2 * len(active) + 64:
            self._summed &= {op.id for op in active}

    def on_committed(self, nodes: Sequence[Node]) -> None:
        """A backup committed `nodes`: the writer journals them, parents first."""
        if not self.journal.writer:
            return
        for node in sorted(nodes, key=lambda n: n.first_position):
            assert node.host_pages is not None
            self.journal.commit(node.host_pages, node.first_position, node.tokens, self._key_before(node))

    def on_free(self, pages: np.ndarray) -> None:
        """`pages` leave L2 (before the allocator may reuse them)."""
        if self.journal.writer:
            self.journal.release(pages)
        self.unverified[np.asarray(pages, np.int64)] = False

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

    # -- the check before first use ----------------------------------------------------

    def check_first_use(self, match: MatchResult, truncate: Callable[[MatchResult, int], None]) -> None:
        """Check the adopted pages of `match`'s host continuation before anything loads
        them; end the continuation before the first node that fails, and drop that
        node's copy. One MIN agreement when the continuation holds unverified pages
        (a replicated fact, so every rank calls it at the same step)."""
        if not match.host_nodes:
            return
        pages = match.host_pages
        todo = np.flatnonzero(self.unverified[pages])
        if not len(todo):
            return
        first = match.host_nodes[0].first_position
        lo, hi = (write_share(first, len(todo), self.node_rank, self.world)
                  if self.sharing is Sharing.REPLICATED else (0, len(todo)))  # fmt: skip
        mine = todo[lo:hi]
        if self.config.cp_size > 1:
            mine = mine[cp_mapping.owned_mask(pages[mine], self.cp_rank, self.config.cp_size)]
        bad = len(pages)
        if len(mine):
            logical = pages[mine]
            physical = cp_mapping.to_physical(logical, self.config.cp_size) if self.config.cp_size > 1 else logical
            views = self._views()
            wrong = (unit_sums(self.layout, views, physical) != self.journal.sums_of(self.copy, logical)).any(axis=1)
            if wrong.any():
                bad = int(mine[np.argmax(wrong)])
        bad = self.agreement.min_int(bad)
        checked = todo[todo < bad]
        self.unverified[pages[checked]] = False
        self.verified_pages += len(checked)
        if bad == len(pages):
            return
        offset, keep = 0, 0
        for node in match.host_nodes:
            if offset + node.num_pages > bad:
                break
            offset += node.num_pages
            keep += 1
        victim = match.host_nodes[keep]
        logger.warning("rank %d: node segment %s: adopted pages of %r failed their checksums before first use; "
                       "dropped (a miss, recomputed)", self.node_rank, self.segment.path, victim)  # fmt: skip
        self.verify_failures += 1
        truncate(match, keep)
        self.unverified[victim.host_pages] = False
        self.drop_copy(victim)

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
        self._copy_views = None
        return self.segment.close(drop=self.config.node_drop_on_close)

