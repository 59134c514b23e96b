"""Prometheus metrics of one `HiCache`, served over HTTP (optional: `prometheus-client`).

    exporter = start_exporter(cache, port=9464)        # binds 127.0.0.1 unless told otherwise
    exporter = start_exporter(cache, port=9464, naming="sglang")   # sglang:hicache_* names
    ...                                                # scrape http://127.0.0.1:9464/metrics
    exporter.stop()

Everything is read from the cache at scrape time (a custom collector over
`HiCache.stats()`, the latency histograms and the event log): the cache's
hot paths do no extra work for it. Names: `NAMINGS[naming]` + the family
name below, so a server's metrics sit beside its engine's (`hicache_*` by
default, `sglang:hicache_*` under SGLang, `vllm:hicache_*` under vLLM).
Every sample is labelled with the CP `rank`. Per tier (l1: the device,
l2: host memory, l3: the shared store):

    prompt_tokens_total                              tokens matched against the cache
    hit_tokens_total{tier}                           prompt tokens served from each tier
    miss_tokens_total                                prompt tokens computed
    bytes_total{tier, direction}                     l2: d2h (committed backups) / h2d (finished loads);
                                                     l3: put (L2 -> store) / get (store -> L2)
    evicted_pages_total{tier}                        pages evicted from L1 / L2 (the store evicts on its own)
    pool_pages{tier, state}                          used / capacity of L1 and L2
    integrity_checked_pages_total{tier}              restored pages whose checksums were checked
    integrity_failures_total{tier, part}             restored (page, part, layer) units that failed a check
                                                     (part "identity": a page holding another copy)
    integrity_dropped_pages_total                    L2 pages whose copy was dropped after a failed check
    backups_total{outcome}                           committed / aborted / skipped
    loads_total{outcome}                             done / aborted / skipped
    inflight_ops{kind}                               backups / loads not yet decided
    kv_events_blocks_total{medium, kind}             blocks announced stored / removed (hicache_cp.events)
    kv_events_seconds_total                          time the cache spent keying and emitting events
    copy_latency_seconds{direction}                  histogram: submission to the poll that saw it done
    decision_latency_seconds{kind}                   histogram: backup start to commit, load start to done

The integrity families read `stats()["integrity"]` when the cache checks
restores: {"checked_pages": {tier: n}, "failures": {tier: {part: n}},
"dropped_pages": n}.
Checked pages are exported at 0 for l2 and l3 otherwise (so a dashboard's
failure ratio reads 0, not "no data"); failures carry a part, so a cache
that checks nothing exports none. `metric_names(naming)` lists every name.
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

#: Name prefix per engine convention (SGLang and vLLM prefix their metrics with "<engine>:").
NAMINGS = {"hicache": "hicache_", "sglang": "sglang:hicache_", "vllm": "vllm:hicache_"}

#: Every family: name (without prefix) -> (type, help, labels besides `rank`). Counters are
#: exposed with `_total`, histograms with `_bucket`, `_sum`, `_count`.
FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "prompt_tokens": ("counter", "Prompt tokens matched against the cache", ()),
    "hit_tokens": ("counter", "Prompt tokens served from a cache tier", ("tier",)),
    "miss_tokens": ("counter", "Prompt tokens computed", ()),
    "bytes": ("counter", "Bytes moved into and out of a tier", ("tier", "direction")),
    "evicted_pages": ("counter", "Pages evicted", ("tier",)),
    "pool_pages": ("gauge", "Pool pages by tier", ("tier", "state")),
    "integrity_checked_pages": ("counter", "Restored pages whose checksums were checked", ("tier",)),
    "integrity_failures": ("counter", "Restored (page, part, layer) units that failed their check", ("tier", "part")),
    "integrity_dropped_pages": ("counter", "L2 pages whose copy was dropped after a failed check", ()),
    "backups": ("counter", "Backups by outcome", ("outcome",)),
    "loads": ("counter", "Loads by outcome", ("outcome",)),
    "inflight_ops": ("gauge", "Ops not yet decided", ("kind",)),
    "kv_events_blocks": ("counter", "Blocks announced in KV cache events", ("medium", "kind")),
    "kv_events_seconds": ("counter", "Seconds the cache spent keying and emitting KV events", ()),
    "copy_latency_seconds": ("histogram", "Copy submission to the poll that saw it done", ("direction",)),
    "decision_latency_seconds": ("histogram", "Op start to its agreed decision", ("kind",)),
}


def metric_names(naming: str = "hicache") -> list[str]:
    """Every sample name the exporter can serve under `naming` (what a dashboard may use)."""
    prefix = NAMINGS[naming]
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    return [prefix + name + s for name, (kind, _, _) in FAMILIES.items() for s in suffixes[kind]]


def family_values(stats: dict[str, Any], log: Any = None) -> dict[str, dict[tuple[str, ...], float]]:
    """Every counter and gauge family's samples (`FAMILIES`, histograms aside) from a
    cache's `stats()` and its event log (None: none): name -> {label values: value}."""
    out: dict[str, dict[tuple[str, ...], float]] = {}
    out["prompt_tokens"] = {(): stats["prompt_tokens"]}
    out["hit_tokens"] = {("l1",): stats["l1_hit_tokens"], ("l2",): stats["l2_hit_tokens"],
                         ("l3",): stats.get("l3_hit_tokens", 0)}  # fmt: skip
    out["miss_tokens"] = {(): stats["miss_tokens"]}
    out["bytes"] = {("l2", "d2h"): stats["bytes_d2h"], ("l2", "h2d"): stats["bytes_h2d"],
                    ("l3", "put"): stats.get("l3_put_bytes", 0), ("l3", "get"): stats.get("l3_get_bytes", 0)}  # fmt: skip
    out["evicted_pages"] = {("l1",): stats["evictions_l1"], ("l2",): stats["evictions_l2"]}
    pool = {}
    for tier in ("l1", "l2"):
        capacity = stats[f"{tier}_capacity_pages"]
        pool[(tier, "capacity")] = capacity
        pool[(tier, "used")] = capacity - stats[f"{tier}_free_pages"]
    out["pool_pages"] = pool
    integrity: Any = stats.get("integrity") or {}
    checked = {"l2": 0, "l3": 0, **integrity.get("checked_pages", {})}
    out["integrity_checked_pages"] = {(tier,): n for tier, n in checked.items()}
    out["integrity_failures"] = {(tier, part): n for tier, parts in integrity.get("failures", {}).items()
                                 for part, n in parts.items()}  # fmt: skip
    out["integrity_dropped_pages"] = {(): integrity.get("dropped_pages", 0)}
    out["backups"] = {("committed",): stats["backups_committed"], ("aborted",): stats["backups_aborted"],
                      ("skipped",): stats["backups_skipped"]}  # fmt: skip
    out["loads"] = {("done",): stats["loads_done"], ("aborted",): stats["loads_aborted"],
                    ("skipped",): stats["loads_skipped"]}  # fmt: skip
    out["inflight_ops"] = {("backup",): stats["backups_in_flight"], ("load",): stats["loads_in_flight"]}
    blocks = dict(log.blocks) if log is not None else {}
    out["kv_events_blocks"] = {(medium, kind): blocks.get((medium, kind), 0)
                               for medium in ("device", "host", "store") for kind in ("stored", "removed")}  # fmt: skip
    out["kv_events_seconds"] = {(): log.seconds if log is not None else 0.0}
    return out


class CacheCollector:
    """A prometheus_client collector over one cache (see the module docstring)."""

    def __init__(self, cache: HiCache, naming: str = "hicache") -> None:
        if naming not in NAMINGS:
            raise ConfigError(f"metrics naming {naming!r}: expected one of {', '.join(NAMINGS)}")
        self.cache = cache
        self.prefix = NAMINGS[naming]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        stats = self.cache.stats()
        metrics = self.cache.metrics
        rank = str(self.cache.rank)
        kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}

        def family(name: str, values: dict[tuple[str, ...], Any]) -> Any:
            kind, doc, labels = FAMILIES[name]
            fam = kinds[kind](self.prefix + name, doc, labels=["rank", *labels])
            for key, value in values.items():
                fam.add_metric([rank, *key], float(value))
            return fam

        for name, values in family_values(stats, self.cache.events).items():
            yield family(name, values)

        def histogram(name: str, series: dict[str, Histogram]) -> Any:
            _, doc, labels = FAMILIES[name]
            fam = HistogramMetricFamily(self.prefix + name, doc, labels=["rank", *labels])
            for key, h in series.items():
                buckets = [("+Inf" if b == float("inf") else repr(b), float(n)) for b, n in h.cumulative()]
                fam.add_metric([rank, key], buckets, sum_value=h.total)
            return fam

        yield histogram("copy_latency_seconds", {"d2h": metrics.copy_latency_d2h, "h2d": metrics.copy_latency_h2d})
        yield histogram("decision_latency_seconds", {"backup": metrics.backup_commit_latency,
                                                     "load": metrics.load_done_latency})  # fmt: skip


@dataclass
class Exporter:
    """A running HTTP endpoint; `stop()` shuts it down (idempotent). `collector.cache`
    is the cache it reads: a server that replaces its cache (a reset) points it at the
    new one."""

    server: Any
    thread: Any
    addr: str
    port: int
    collector: CacheCollector

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(timeout=5)
            self.server = None


def start_exporter(cache: HiCache, port: int, addr: str = DEFAULT_ADDR, naming: str = "hicache") -> Exporter:
    """Serve `cache`'s metrics at http://addr:port/metrics on a daemon thread.

    `port` 0 picks a free port (see `Exporter.port`); `naming` picks the
    names' prefix (`NAMINGS`). Raises ConfigError for a bad port or naming
    and ImportError when prometheus-client is not installed (the extra
    `metrics`); OSError when the address cannot be bound."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"metrics port must be in [0, 65535], got {port}")
    collector = CacheCollector(cache, naming)
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)  # type: ignore[arg-type]
    server, thread = start_http_server(port, addr=addr, registry=registry)
    bound = int(server.server_address[1])
    logger.info("rank %d: metrics at http://%s:%d/metrics", cache.rank, addr, bound)
    return Exporter(server, thread, addr, bound, collector)
