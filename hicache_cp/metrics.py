"""Cache counters (plain integers) and latency histograms, snapshotted by
`HiCache.stats()` and exported by `hicache_cp.prometheus`.

Latencies use wall time and only ever feed these metrics, never a cache
decision (those use the logical clock and agreed state only).
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from dataclasses import dataclass, field

#: Upper bounds (seconds) of the latency buckets: 10 us .. 10 s, roughly x2.5 apart.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip


@dataclass
class Histogram:
    """Counts per bucket (cumulative on export), their sum and count. O(log buckets) a sample."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)  # one per bound, plus +Inf
    total: float = 0.0
    samples: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.samples += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, samples at or below it), the last bound being +inf."""
        out, running = [], 0
        for bound, count in zip([*self.bounds, float("inf")], self.counts):
            running += count
            out.append((bound, running))
        return out


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
    backup_pages_wanted: int = 0  # pages backups asked L2 for (computed pages, under write-through)
    backup_pages_skipped: int = 0  # of those, pages L2 had no room for: they never get an L2 copy (nor an L3 one)
    # Of those, pages a request added to the tree whose reservation was released without
    # a copy (insert found part of the path present, a copy failed, an abort).
    backup_pages_dropped: int = 0
    # Pages of write-through reservations whose positions insert found in the tree
    # already (with a host copy, or held L1 pages): released at the decision.
    backup_pages_trimmed: int = 0
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
    integrity_dropped_pages: int = 0  # L2 pages whose copy was dropped after a failed restore check
    # Wall time from submission to the poll that saw the copy done (an upper bound).
    copy_latency_d2h: Histogram = field(default_factory=Histogram)
    copy_latency_h2d: Histogram = field(default_factory=Histogram)
    # Wall time from an op's start to its agreed decision.
    backup_commit_latency: Histogram = field(default_factory=Histogram)
    load_done_latency: Histogram = field(default_factory=Histogram)

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
        """The counters (histograms as their sample count and mean)."""
        d: dict[str, object] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Histogram):
                d[f"{f.name}_samples"] = value.samples
                d[f"{f.name}_mean_s"] = value.total / value.samples if value.samples else 0.0
            else:
                d[f.name] = value
        d["hit_rate"] = self.hit_rate
        return d


class IntegrityStats:
    """Counters of the restore checks (`hicache_cp.checksum`), per tier ("l2", "l3", "pd").

    Thread-safe: the cpu io backend's copy workers and the L3 get worker count
    here too. `checked` counts (page, part, layer) units compared, `failed` the
    units that differed (by tier and part); `HiCache.stats()` reports them as
    `verified_units` / `verified_pages` and `verify_failures`, and the
    Prometheus exporter as `hicache_integrity_checked_pages_total{tier}` and
    `hicache_integrity_failures_total{tier,part}`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.checked: dict[str, int] = {}
        self.failed: dict[tuple[str, str], int] = {}

    def count_checked(self, tier: str, units: int) -> None:
        with self._lock:
            self.checked[tier] = self.checked.get(tier, 0) + units

    def count_failed(self, tier: str, part: str, units: int) -> None:
        with self._lock:
            self.failed[(tier, part)] = self.failed.get((tier, part), 0) + units

    def snapshot(self) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
        with self._lock:
            return dict(self.checked), dict(self.failed)

    def as_dict(self, units_per_page: int) -> dict[str, object]:
        """`verified_units`, `verified_pages` (units / units a page), `verify_failures`,
        and per tier `verified_units_<tier>` and `verify_failures_<tier>_<part>`."""
        checked, failed = self.snapshot()
        total = sum(checked.values())
        d: dict[str, object] = {
            "verified_units": total,
            "verified_pages": total // max(1, units_per_page),
            "verify_failures": sum(failed.values()),
        }
        for tier, n in sorted(checked.items()):
            d[f"verified_units_{tier}"] = n
        for (tier, part), n in sorted(failed.items()):
            d[f"verify_failures_{tier}_{part}"] = n
        return d

    def families(self, units_per_page: int, dropped_pages: int) -> dict[str, object]:
        """The Prometheus exporter's families (`HiCache.stats()["integrity"]`): pages
        checked per tier, failed units per tier and part, and the pages dropped."""
        checked, failed = self.snapshot()
        failures: dict[str, dict[str, int]] = {}
        for (tier, part), n in failed.items():
            failures.setdefault(tier, {})[part] = n
        return {"checked_pages": {tier: n // max(1, units_per_page) for tier, n in checked.items()},
                "failures": failures, "dropped_pages": dropped_pages}  # fmt: skip
