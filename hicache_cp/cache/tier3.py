"""Tier3: the L3 tier (a shared object store, Mooncake Store) below L2.

Two flows, each an explicit state machine (`hicache_cp.l3.ops`), each in its
own module: prefetches in `l3_prefetch.L3Prefetcher`, write-backs in
`l3_writer.L3Writer`, over one `L3Client`, one key scheme and the chain hashes
they share (`l3_hashes.ChainHashes`). This class is their facade:

    prefetch(match)   read the L3 continuation of a match into reserved L2 pages
                      (`L3Prefetcher.start`): lookup, a length agreed over the CP
                      group, a read that commits (the pages join the tree as L2
                      copies, all parts at once) or aborts on every rank together;
                      a request may wait for it, within the deadline
    prefetch_queued   the same for a request that is queued, not scheduled yet
                      (`HiCache.prefetch_queued`): never waits; what landed by
                      the time the request is matched is in L2 for it.
    claim(m)          a match uses host copies: the pages among them that an L3
                      prefetch committed and no request used yet count as L3
                      hits (once per landed copy; `fresh`), the rest as L2 hits.
    on_committed(n)   a backup committed: queue a write-back of the node's pages
                      (`L3Writer`: bounded, holding its L2 pages until it retires)

Both kinds of op vote in the cache's one agreement per poll (`Lifecycle.poll`
lists them after the backups and loads), so every rank applies the same
decision at the same step. Creating them is a replicated decision too (it
reads only replicated state); what a rank's store call did is rank-local and
only reaches the others through the votes.

The store is optional at every step: while it is unreachable (`L3Client`
health DOWN) lookups answer "absent", prefetches and puts are not issued,
and the cache serves from L1 and L2; it resumes when a probe answers.

Runs in: the cache's thread; the store calls run on `L3Client`'s workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from hicache_cp.cache.eviction import Evictor
from hicache_cp.cache.l3_hashes import ChainHashes
from hicache_cp.cache.l3_hits import HitObserver, L3Hits
from hicache_cp.cache.l3_prefetch import L3Prefetcher
from hicache_cp.cache.l3_writer import L3Writer, PutObserver
from hicache_cp.cache.state import CacheState
from hicache_cp.cache.store_events import StoreEvents
from hicache_cp.cp.agreement import Vote
from hicache_cp.l3.client import L3Client
from hicache_cp.l3.config import L3Config
from hicache_cp.l3.keys import KeyScheme
from hicache_cp.l3.metrics import L3Metrics
from hicache_cp.l3.ops import PrefetchOp, WriteJob
from hicache_cp.match import MatchResult
from hicache_cp.ops import LoadOp
from hicache_cp.radix import Node


class L3Observer(HitObserver, PutObserver, Protocol):
    """Optional hooks for a harness (cross-instance accounting): this rank's puts
    (`PutObserver`) and the objects behind its L3 hits (`HitObserver`). Called on
    the cache's thread."""


class Tier3:
    """The L3 tier of one cache rank; see the module docstring."""

    def __init__(self, state: CacheState, evictor: Evictor, client: L3Client, config: L3Config) -> None:
        self.s = state
        self.client = client
        self.scheme: KeyScheme = client.scheme
        self.config = config
        self.metrics: L3Metrics = client.metrics
        #: Which L2 copies an L3 prefetch landed and no match used yet (`claim`).
        self.hits = L3Hits(state, self.metrics, state.host_pool.allocator.capacity)
        hashes = ChainHashes(state)
        self.prefetcher = L3Prefetcher(state, evictor, client, config, self.hits, hashes)
        self.writer = L3Writer(state, client, config, hashes)
        self._observer: L3Observer | None = None

    @property
    def observer(self) -> L3Observer | None:
        """The harness's hooks (`L3Observer`), heard by both flows."""
        return self._observer

    @observer.setter
    def observer(self, observer: L3Observer | None) -> None:
        self._observer = self.prefetcher.observer = self.writer.observer = observer

    @property
    def events(self) -> StoreEvents | None:
        """STORE events, when the cache has an event log (`HiCache.attach_events`)."""
        return self.writer.events

    @events.setter
    def events(self, events: StoreEvents | None) -> None:
        self.prefetcher.events = self.writer.events = events

    @property
    def busy(self) -> bool:
        """Prefetches or write-backs still active (their counters are not final yet)."""
        return bool(self.prefetcher.prefetches or self.writer.writes)

    @property
    def prefetches(self) -> list[PrefetchOp]:
        """The active prefetches, in creation order."""
        return self.prefetcher.prefetches

    @property
    def writes(self) -> list[WriteJob]:
        """The active write-back jobs, in creation order."""
        return self.writer.writes

    @property
    def deferred(self) -> np.ndarray:
        """Per logical L2 page: evicted while a write job holds it (`L3Writer.deferred`)."""
        return self.writer.deferred

    @property
    def queued_pages(self) -> int:
        """L2 pages the write jobs hold (`L3Writer.queued_pages`)."""
        return self.writer.queued_pages

    def claim(self, m: MatchResult) -> None:
        """`match_prefix(m)` used host copies: the landed ones count as L3 hits (`L3Hits.claim`)."""
        self.hits.claim(m, self._observer)

    def note_load(self, m: MatchResult, load: LoadOp | None) -> None:
        """`load_back(m)` ran (`L3Hits.note_load`)."""
        self.hits.note_load(m, load)

    # ---- prefetch (`L3Prefetcher`) ------------------------------------------------------------

    def prefetch(self, m: MatchResult, wait: bool) -> PrefetchOp | None:
        """Start fetching the L3 continuation of `m` (`L3Prefetcher.start`); see
        `HiCache.prefetch`. A match counts as hits, so under `write_min_hits`
        its nodes that just reached it are queued for write-back first."""
        self.writer.write_on_hits(m)
        return self.prefetcher.start(m, wait)

    def prefetch_queued(self, m: MatchResult) -> PrefetchOp | None:
        """`prefetch(m, wait=False)` for a queued request's `m` from
        `Prefixes.peek` (no hit was counted, so no write-back is due)."""
        return self.prefetcher.start(m, wait=False)

    def wait_local(self, op: PrefetchOp) -> None:
        """Block until this rank's read of `op` returned or its deadline passed."""
        self.prefetcher.wait_local(op)

    def cancel(self, op: PrefetchOp) -> None:
        """Ask for an abort of `op` (agreed at the next poll)."""
        self.prefetcher.cancel(op)

    # ---- decisions (from Lifecycle.poll) ------------------------------------------------------

    def poll_ops(self) -> list[PrefetchOp | WriteJob]:
        """The ops that vote in this poll, in the agreement's order."""
        self.client.tick()
        return [*self.prefetcher.prefetches, *self.writer.writes]

    def decide(self, decisions: Sequence[tuple[PrefetchOp | WriteJob, Vote]]) -> None:
        """Apply the agreed votes: commit/abort prefetches, retire write jobs."""
        for op, vote in decisions:
            if isinstance(op, PrefetchOp):
                self.prefetcher.decide(op, vote)
            elif vote.settled:
                self.writer.retire(op)
        self.prefetcher.drop_decided()
        self.writer.drop_retired()
        self.hits.correct_aborted_loads()

    # ---- write-back (`L3Writer`) --------------------------------------------------------------

    def on_committed(self, nodes: Sequence[Node]) -> None:
        """Backups committed these nodes' host copies: queue their write-back."""
        self.writer.on_committed(nodes)

    def yield_queued_puts(self) -> bool:
        """See `L3Hooks.yield_queued_puts` (`L3Writer.yield_queued_puts`)."""
        return self.writer.yield_queued_puts()

    def on_evict_l2(self, pages: np.ndarray) -> np.ndarray:
        """L2 evicts `pages`: return those free now; held ones wait for their job.
        Their copies leave the tree: none is fresh any more."""
        self.hits.forget(pages)
        return self.writer.on_evict_l2(pages)

    # ---- introspection and teardown ----------------------------------------------------------

    def wait_inflight(self) -> None:
        """Wait for this rank's prefetch reads (each up to its deadline): `settle`."""
        self.prefetcher.wait_inflight()

    def owned_host_pages(self) -> list[np.ndarray]:
        """L2 pages outside the tree that the tier holds: prefetch reservations
        and evicted pages waiting for a write-back."""
        return [*self.prefetcher.owned_host_pages(), self.writer.owned_host_pages()]

    def check_invariants(self) -> None:
        self.writer.check_invariants()
        self.prefetcher.check_invariants()
        self.hits.check_invariants()

    def stats(self) -> dict[str, object]:
        d = self.metrics.as_dict()
        d["l3_health"] = self.client.health.value
        d["l3_prefetches_in_flight"] = len(self.prefetcher.prefetches)
        d["l3_write_jobs_in_flight"] = len(self.writer.writes)
        d["l3_held_pages"] = int((self.writer.held > 0).sum())
        d["l3_fingerprint"] = self.scheme.fingerprint
        requests = max(1, self.s.metrics.requests)
        keys = self.metrics.l3_lookup_keys + self.metrics.l3_get_keys + self.metrics.l3_put_keys
        d["l3_keys_per_request"] = round(keys / requests, 3)
        return d

    def close(self) -> bool:
        """Stop the workers (see `L3Client.close`); False: the L2 arenas must stay mapped."""
        return self.client.close()
