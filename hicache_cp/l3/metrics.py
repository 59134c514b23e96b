"""The L3 tier's counters (plain integers), merged into `HiCache.stats()`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class L3Metrics:
    # hits (tokens and pages a request got from L3, through L2, within its deadline)
    l3_hit_tokens: int = 0
    l3_hit_pages: int = 0
    # lookups
    l3_lookups: int = 0
    l3_lookup_keys: int = 0
    # prefetch
    l3_prefetch_started: int = 0
    l3_prefetch_committed: int = 0
    l3_prefetch_aborted: int = 0
    l3_prefetch_timeouts: int = 0
    l3_prefetch_cancelled: int = 0
    l3_prefetch_no_room: int = 0  # L2 could not reserve the pages
    l3_prefetch_pages: int = 0  # pages committed into L2
    l3_surplus_pages: int = 0  # landed pages the tree already had (freed)
    l3_get_keys: int = 0
    l3_get_bytes: int = 0
    # write-back
    l3_put_jobs: int = 0
    l3_put_keys: int = 0
    l3_put_bytes: int = 0
    l3_put_skipped_present: int = 0  # keys already in L3
    l3_put_skipped_full: int = 0  # pages: the queue was full
    l3_put_yielded: int = 0  # pages: their put was cancelled before it started, a backup took their L2 pages
    l3_put_skipped_down: int = 0  # pages: the store was down
    l3_put_failed_keys: int = 0
    l3_deferred_frees: int = 0  # evicted L2 pages whose free waited for a put
    # faults
    l3_failures: int = 0  # failed store operations of any kind (lookup, get, put)
    l3_down_events: int = 0
    l3_resumed_events: int = 0
    l3_quarantined_ops: int = 0

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)
