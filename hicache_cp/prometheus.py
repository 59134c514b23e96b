"""Prometheus metrics of one `HiCache`, served over HTTP (optional: `prometheus-client`).

    exporter = start_exporter(cache, port=9464)        # binds 127.0.0.1 unless told otherwise
    ...                                                # scrape http://127.0.0.1:9464/metrics
    exporter.stop()

Everything is read from the cache at scrape time (a custom collector over
`HiCache.stats()` and the latency histograms): the cache's hot paths do
no extra work for it. Metrics, each labelled with the CP `rank`:

    hicache_prompt_tokens_total                      tokens matched against the cache
    hicache_hit_tokens_total{tier="l1"|"l2"|"l3"}    prompt tokens served from each tier
    hicache_miss_tokens_total                        prompt tokens computed
    hicache_bytes_total{direction="d2h"|"h2d"}       bytes of committed backups / finished loads
    hicache_evicted_pages_total{tier}                pages evicted from L1 / L2
    hicache_backups_total{outcome="committed"|"aborted"|"skipped"}
    hicache_loads_total{outcome="done"|"aborted"|"skipped"}
    hicache_inflight_ops{kind="backup"|"load"}       ops not yet decided
    hicache_pool_pages{tier, state="used"|"capacity"}
    hicache_copy_latency_seconds{direction}          histogram: submission to the poll that saw it done
    hicache_decision_latency_seconds{kind}           histogram: backup start to commit, load start to done
    hicache_integrity_checked_pages_total{tier}      restored pages checked against their checksums
                                                     (page, part, layer units / units a page)
    hicache_integrity_failures_total{tier,part}      restored (page, part, layer) units that failed a check
                                                     (part "identity": a page holding another copy)
    hicache_integrity_dropped_pages_total            L2 pages whose copy was dropped after a failed check

The scrape thread only reads integers and copies short lists; a scrape
never blocks the cache.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hicache_cp.cache import HiCache
from hicache_cp.errors import ConfigError
from hicache_cp.metrics import Histogram

logger = logging.getLogger(__name__)

DEFAULT_ADDR = "127.0.0.1"


class CacheCollector:
    """A prometheus_client collector over one cache (see the module docstring)."""

    def __init__(self, cache: HiCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        stats = self.cache.stats()
        metrics = self.cache.metrics
        rank = str(self.cache.rank)

        def counter(name: str, doc: str, label: str | None, values: dict[str, Any]) -> Any:
            family = CounterMetricFamily(name, doc, labels=["rank", *([label] if label else [])])
            for key, value in values.items():
                family.add_metric([rank, *([key] if label else [])], float(value))
            return family

        yield counter("hicache_prompt_tokens", "Prompt tokens matched against the cache", None,
                      {"": stats["prompt_tokens"]})
        yield counter("hicache_hit_tokens", "Prompt tokens served from a cache tier", "tier",
                      {"l1": stats["l1_hit_tokens"], "l2": stats["l2_hit_tokens"], "l3": stats.get("l3_hit_tokens", 0)})
        yield counter("hicache_miss_tokens", "Prompt tokens computed", None, {"": stats["miss_tokens"]})
        yield counter("hicache_bytes", "Bytes moved by committed backups and finished loads", "direction",
                      {"d2h": stats["bytes_d2h"], "h2d": stats["bytes_h2d"]})
        yield counter("hicache_evicted_pages", "Pages evicted", "tier",
                      {"l1": stats["evictions_l1"], "l2": stats["evictions_l2"]})
        yield counter("hicache_backups", "Backups by outcome", "outcome",
                      {"committed": stats["backups_committed"], "aborted": stats["backups_aborted"],
                       "skipped": stats["backups_skipped"]})
        yield counter("hicache_loads", "Loads by outcome", "outcome",
                      {"done": stats["loads_done"], "aborted": stats["loads_aborted"], "skipped": stats["loads_skipped"]})
        yield from self._integrity(counter)
        inflight = GaugeMetricFamily("hicache_inflight_ops", "Ops not yet decided", labels=["rank", "kind"])
        inflight.add_metric([rank, "backup"], stats["backups_in_flight"])
        inflight.add_metric([rank, "load"], stats["loads_in_flight"])
        yield inflight
        pool = GaugeMetricFamily("hicache_pool_pages", "Pool pages by tier", labels=["rank", "tier", "state"])
        for tier in ("l1", "l2"):
            capacity = stats[f"{tier}_capacity_pages"]
            pool.add_metric([rank, tier, "capacity"], capacity)
            pool.add_metric([rank, tier, "used"], capacity - stats[f"{tier}_free_pages"])
        yield pool

        def histogram(name: str, doc: str, label: str, series: dict[str, Histogram]) -> Any:
            family = HistogramMetricFamily(name, doc, labels=["rank", label])
            for key, h in series.items():
                buckets = [("+Inf" if b == float("inf") else repr(b), float(n)) for b, n in h.cumulative()]
                family.add_metric([rank, key], buckets, sum_value=h.total)
            return family

        yield histogram("hicache_copy_latency_seconds", "Copy submission to the poll that saw it done", "direction",
                        {"d2h": metrics.copy_latency_d2h, "h2d": metrics.copy_latency_h2d})
        yield histogram("hicache_decision_latency_seconds", "Op start to its agreed decision", "kind",
                        {"backup": metrics.backup_commit_latency, "load": metrics.load_done_latency})


    def _integrity(self, counter: Any) -> Iterator[Any]:
        """The restore checks' counters (`hicache_cp.metrics.IntegrityStats`), every tier
        with a check listed (l2 always, l3 and pd once they counted)."""
        from prometheus_client.core import CounterMetricFamily

        checked, failed = self.cache.engine.integrity.snapshot()  # the L3 tier counts there too
        units = sum(p.num_slots for p in self.cache.layout.parts)
        pages = {tier: n // units for tier, n in checked.items()}
        pages.setdefault("l2", 0)
        yield counter("hicache_integrity_checked_pages", "Restored pages checked against their checksums", "tier", pages)
        family = CounterMetricFamily("hicache_integrity_failures", "Restored (page, part, layer) units that failed a check",
                                     labels=["rank", "tier", "part"])  # fmt: skip
        rank = str(self.cache.rank)
        for (tier, part), n in sorted(failed.items()):
            family.add_metric([rank, tier, part], float(n))
        yield family
        yield counter("hicache_integrity_dropped_pages", "L2 pages dropped after a failed check", None,
                      {"": self.cache.metrics.integrity_dropped_pages})


@dataclass
class Exporter:
    """A running HTTP endpoint; `stop()` shuts it down (idempotent)."""

    server: Any
    thread: Any
    addr: str
    port: int

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(timeout=5)
            self.server = None


def start_exporter(cache: HiCache, port: int, addr: str = DEFAULT_ADDR) -> Exporter:
    """Serve `cache`'s metrics at http://addr:port/metrics on a daemon thread.

    `port` 0 picks a free port (see `Exporter.port`). Raises ConfigError for a
    bad port and ImportError when prometheus-client is not installed (the
    extra `metrics`); OSError when the address cannot be bound."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"metrics port must be in [0, 65535], got {port}")
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(CacheCollector(cache))  # type: ignore[arg-type]
    server, thread = start_http_server(port, addr=addr, registry=registry)
    bound = int(server.server_address[1])
    logger.info("rank %d: metrics at http://%s:%d/metrics", cache.rank, addr, bound)
    return Exporter(server, thread, addr, bound)
