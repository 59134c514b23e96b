"""Cache counters: plain integers, snapshotted by `HiCache.stats()`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class CacheMetrics:
    requests: int = 0
    prompt_tokens: int = 0
    l1_hit_tokens: int = 0
    l2_hit_tokens: int = 0
    miss_tokens: int = 0
    l1_hit_pages: int = 0
    l2_hit_pages: int = 0
    backups_started: int = 0
    backups_committed: int = 0
    backups_aborted: int = 0
    backups_skipped: int = 0  # L2 could not make room
    backups_all_layer: int = 0  # the non-overlapped fallback path
    loads_started: int = 0
    loads_done: int = 0
    loads_aborted: int = 0
    loads_skipped: int = 0  # L1 could not take a host hit
    l1_alloc_failures: int = 0
    evictions_l1: int = 0  # pages
    evictions_l2: int = 0  # pages
    bytes_d2h: int = 0
    bytes_h2d: int = 0

    def record_match(self, tokens: int, device_pages: int, host_pages: int, page_size: int) -> None:
        self.requests += 1
        self.prompt_tokens += tokens
        self.l1_hit_pages += device_pages
        self.l2_hit_pages += host_pages
        self.l1_hit_tokens += device_pages * page_size
        self.l2_hit_tokens += host_pages * page_size
        self.miss_tokens += tokens - (device_pages + host_pages) * page_size

    @property
    def hit_rate(self) -> float:
        return (self.l1_hit_tokens + self.l2_hit_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, object]:
        d: dict[str, object] = dataclasses.asdict(self)
        d["hit_rate"] = self.hit_rate
        return d
