"""L3Writer: the write-back flow of the L3 tier (`cache/tier3.py`).

    on_committed(n)   a backup committed: queue a write-back of the node's pages
                      (policy: hit at least `write_min_hits` times, `write_on_hits`;
                      the queue is bounded in pages and skips what does not fit;
                      keys already in L3 are skipped by the worker). The job holds
                      its L2 pages: L2 eviction takes them out of the tree at once
                      but frees them only when the job retires (`on_evict_l2`). A
                      backup that finds no room in L2 takes evicted pages back from
                      the jobs whose puts have not started (`yield_queued_puts`), so
                      the queue never starves L2 of new copies.
    retire(job)       the agreed poll settled the job: release its holds, count
                      what its put stored (`WriteJob`: QUEUED -> RETIRED).

Creating a job reads replicated state only; what a rank's put did reaches the
other ranks only through the job's vote.

Runs in: the cache's thread; the puts run on `L3Client`'s workers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from hicache_cp.cache.l3_hashes import ChainHashes
from hicache_cp.cache.state import CacheState
from hicache_cp.cache.store_events import StoreEvents
from hicache_cp.l3.client import L3Client, PutOutcome
from hicache_cp.l3.config import L3Config
from hicache_cp.l3.keys import PositionHashes
from hicache_cp.l3.ops import WriteJob, WriteState
from hicache_cp.match import MatchResult
from hicache_cp.radix import HostState, Node

logger = logging.getLogger(__name__)


class PutObserver(Protocol):
    """Hears this rank's puts (`Tier3`'s observer). Called on the cache's thread."""

    def on_l3_put_started(self, keys: list[str]) -> None:
        """This rank submitted a put of these object keys (they may show up in the store before it retires)."""

    def on_l3_put(self, keys: list[str], stored: list[str]) -> None:
        """The put of `keys` (from `on_l3_put_started`) retired; this rank stored
        `stored` of them (the others were present already, failed or yielded)."""


class L3Writer:
    """The write-back jobs of one cache rank and the L2 pages they hold."""

    def __init__(self, state: CacheState, client: L3Client, config: L3Config, hashes: ChainHashes) -> None:
        self.s = state
        self.client = client
        self.scheme = client.scheme
        self.config = config
        self.metrics = client.metrics
        self.hashes = hashes
        self.observer: PutObserver | None = None
        self.events: StoreEvents | None = None  # STORE events, when the cache has an event log
        self.writes: list[WriteJob] = []  # active, creation order (the agreement's order)
        capacity = state.host_pool.allocator.capacity
        self.held = np.zeros(capacity + 1, dtype=np.int32)  # logical L2 page -> write jobs holding it
        self.deferred = np.zeros(capacity + 1, dtype=bool)  # evicted while held: freed when released
        self.queued_pages = 0
        #: Write-back bound in pages: what puts in flight may hold of L2 (replicated).
        self.queue_limit = config.write_queue_pages or max(1, capacity // 4)

    def on_committed(self, nodes: Sequence[Node]) -> None:
        """Backups committed these nodes' host copies: queue their write-back."""
        if self.config.write_min_hits > 0:
            return  # written when hit often enough (`write_on_hits`)
        for node in nodes:
            self._enqueue(node)

    def write_on_hits(self, m: MatchResult) -> None:
        """Under `write_min_hits`, queue committed nodes of this match that just reached it."""
        k = self.config.write_min_hits
        if k == 0:
            return
        node: Node | None = m.last_node
        while node is not None and node is not self.s.tree.root:
            if node.hit_count == k and node.host_state is HostState.COMMITTED:
                self._enqueue(node)
            node = node.parent

    def _enqueue(self, node: Node) -> None:
        g = self.scheme.group
        a, b = node.first_position, node.end_position
        k_lo, k_hi = (a + g) // g - 1, b // g  # groups whose last page lies in [a, b)
        if k_lo >= k_hi:
            return
        runs = self._host_run(node, k_lo * g)
        if runs is None:  # a group's head lacks a committed host copy: write the groups that do not need it
            k_lo = (a + g - 1) // g
            if k_lo >= k_hi:
                return
            runs = self._host_run(node, k_lo * g)
            assert runs is not None
        held = runs[: (k_hi - k_lo) * g]
        if self.queued_pages + len(held) > self.queue_limit:
            self.metrics.l3_put_skipped_full += len(held)
            return
        hashes = PositionHashes(a, self.hashes.node(node))
        objects = self.scheme.objects(hashes, range(k_lo, k_hi))
        physical = [self.scheme.physical(held, k_lo * g, o) for o in objects]
        job = WriteJob(held, objects, physical, hold_s=self.config.hold_after_unsafe_failure_s)
        self.held[held] += 1
        self.queued_pages += len(held)
        if objects and self.client.up:
            job.future = self.client.submit_put(objects, physical)
            if self.events is not None:
                self.events.queued(job, node, k_lo * g, k_hi * g)
            self.metrics.l3_put_jobs += 1
            if self.observer is not None:
                self.observer.on_l3_put_started([o.key for o in objects])
        elif objects:
            self.metrics.l3_put_skipped_down += sum(len(o.positions) for o in objects)
        self.writes.append(job)

    def _host_run(self, node: Node, lo: int) -> np.ndarray | None:
        """Logical L2 pages of positions [lo, node.end) from the node and its
        ancestors' committed host copies; None if one lacks it."""
        parts: list[np.ndarray] = []
        n: Node | None = node
        while n is not None and n is not self.s.tree.root and n.end_position > lo:
            if n.host_state is not HostState.COMMITTED or n.host_pages is None:
                return None
            parts.append(n.host_pages[max(0, lo - n.first_position) :])
            n = n.parent
        parts.reverse()
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def retire(self, job: WriteJob) -> None:
        """The agreed poll settled `job`: release its holds and count its put."""
        s = self.s
        job.transition(WriteState.RETIRED)
        self.held[job.held] -= 1
        self.queued_pages -= len(job.held)
        done = job.held[(self.held[job.held] == 0) & self.deferred[job.held]]
        if len(done):
            self.deferred[done] = False
            s.free_host_pages(done)
        if job.future is None:
            return
        if job.yielded:
            self.metrics.l3_put_yielded += sum(len(o.positions) for o in job.objects)
            self._observe_put(job, [])
            return
        if job.error is not None:
            self.client.failed(job.error)
            if job.quarantined:
                self.metrics.l3_quarantined_ops += 1
            logger.warning("rank %d: write-back job %d failed: %s", s.rank, job.id, job.error)
            self._observe_put(job, [])
            return
        out: PutOutcome = job.future.result()
        self.metrics.l3_put_keys += out.keys_put
        self.metrics.l3_put_bytes += out.bytes_put
        self.metrics.l3_put_skipped_present += out.skipped_present
        self.metrics.l3_put_failed_keys += len(out.errors)
        for err in out.errors[:1]:
            self.client.failed(err)
            logger.warning("rank %d: write-back job %d: %d of its keys not stored, e.g. %s",
                           s.rank, job.id, len(out.errors), err)  # fmt: skip
        self._observe_put(job, out.put_keys, clean=not out.errors)

    def drop_retired(self) -> None:
        """Forget the jobs `retire` ended (after a poll's decisions)."""
        self.writes = [job for job in self.writes if job.active]

    def _observe_put(self, job: WriteJob, stored: list[str], clean: bool = False) -> None:
        if self.events is not None:
            self.events.retired(job, clean)
        if self.observer is not None:
            self.observer.on_l3_put([o.key for o in job.objects], stored)

    def yield_queued_puts(self) -> bool:
        """See `L3Hooks.yield_queued_puts`. Cancels, on this rank, the puts of
        jobs holding an evicted page that the put worker has not taken yet; a
        job retires at the next agreed poll once no rank's put of it runs (a
        rank whose put had started keeps every rank's pages until it ends).
        O(jobs + held pages)."""
        holding = False
        for job in self.writes:
            if not self.deferred[job.held].any():
                continue
            holding = True
            if job.future is not None and not job.yielded and job.future.cancel():
                job.yielded = True
        return holding

    def on_evict_l2(self, pages: np.ndarray) -> np.ndarray:
        """L2 evicts `pages`: return those free now; held ones wait for their job."""
        mask = self.held[pages] > 0
        if not mask.any():
            return pages
        self.deferred[pages[mask]] = True
        self.metrics.l3_deferred_frees += int(mask.sum())
        return pages[~mask]

    def owned_host_pages(self) -> np.ndarray:
        """Evicted L2 pages waiting for a write-back (outside the tree)."""
        return np.flatnonzero(self.deferred)

    def check_invariants(self) -> None:
        held = np.zeros_like(self.held)
        for job in self.writes:
            assert job.active, f"write job {job.id} retired but listed"
            np.add.at(held, job.held, 1)
        assert np.array_equal(held, self.held), "L3 hold counts drifted from the active write jobs"
        assert self.queued_pages == sum(len(j.held) for j in self.writes), "L3 queue size drifted"
        assert not (self.deferred & (self.held == 0)).any(), "an evicted L2 page waits for no write job"
