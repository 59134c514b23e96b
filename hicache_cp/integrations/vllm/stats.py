"""The connector's metrics through vLLM's own path: KV connector stats and vLLM's /metrics.

Every step vLLM asks the scheduler side and each worker for
`get_kv_connector_stats()`, sums what they return and hands the dict to its
loggers, in the API server's process: `HiCacheStats` (rebuilt by the
connector's `build_kv_connector_stats`) gives vLLM's periodic "KV Transfer
metrics" log line, and `HiCachePromMetrics` (its `build_prom_metrics`)
registers the `vllm:hicache_*` families on vLLM's own /metrics. They are the
families, names and labels of `hicache_cp.prometheus` (histograms aside), so
the Grafana dashboard reads them with its `vllm:hicache_` naming.

Each side reports what changed since its last report (`Reporter`): counter
increments, and gauges whose value changed. The scheduler side reports its
cache's families; a worker its restore checks, which run where the copies
land, so `integrity_checked_pages_total` sums the pages each worker checked.
The data is plain (string keys, numbers): vLLM serialises it between
processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from hicache_cp import METRIC_FAMILIES

if TYPE_CHECKING:
    from vllm.config import VllmConfig

PREFIX = "vllm:hicache_"
#: A sample's key in the data: the family name and its label values.
SEP = "|"
#: The families whose increments make vLLM's periodic log line.
LOGGED = ("hit_tokens", "bytes", "evicted_pages", "integrity_failures")
FAMILIES = {name: spec for name, spec in METRIC_FAMILIES.items() if spec[0] != "histogram"}

Values = dict[str, dict[tuple[str, ...], float]]


@dataclass
class HiCacheStats(KVConnectorStats):
    """{"counters": {key: increment}, "gauges": {key: value}} of one interval; summed over
    the scheduler and the workers (counters add, a gauge keeps the latest value)."""

    def __post_init__(self) -> None:
        self.data.setdefault("counters", {})
        self.data.setdefault("gauges", {})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, HiCacheStats):
            raise TypeError(f"hicache-cp stats cannot aggregate {type(other).__name__}")
        counters = self.data["counters"]
        for key, n in other.data["counters"].items():
            counters[key] = counters.get(key, 0) + n
        self.data["gauges"].update(other.data["gauges"])
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key.replace(SEP, "_"): n for key, n in sorted(self.data["counters"].items())
                if key.split(SEP, 1)[0] in LOGGED}  # fmt: skip

    def is_empty(self) -> bool:
        return not self.data["counters"] and not self.data["gauges"]


class Reporter:
    """One side's reports: the increments of cumulative family values since the last one
    (a counter that went down was restarted, a reset cache: its whole value is new)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def report(self, values: Values) -> HiCacheStats | None:
        counters: dict[str, float] = {}
        gauges: dict[str, float] = {}
        for name, samples in values.items():
            counter = FAMILIES[name][0] == "counter"
            for labels, value in samples.items():
                key = SEP.join((name, *labels))
                before = self._last.get(key)
                self._last[key] = value
                if counter:
                    step = value - before if before is not None and value >= before else value
                    if step:
                        counters[key] = step
                elif value != before:
                    gauges[key] = value
        stats = HiCacheStats({"counters": counters, "gauges": gauges})
        return None if stats.is_empty() else stats


def integrity_values(families: dict[str, Any]) -> Values:
    """A worker's restore checks (`IntegrityStats.families`) as family values."""
    return {"integrity_checked_pages": {(tier,): n for tier, n in families["checked_pages"].items()},
            "integrity_failures": {(tier, part): n for tier, parts in families["failures"].items()
                                   for part, n in parts.items()}}  # fmt: skip


class HiCachePromMetrics(KVConnectorPromMetrics):
    """The `vllm:hicache_*` families on vLLM's /metrics, fed by `observe` (see the module
    docstring); labelled with vLLM's engine labels, then the family's own."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:  # fmt: skip
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.families: dict[str, Any] = {}
        for name, (kind, doc, labels) in FAMILIES.items():
            names = [*self._labelnames, *labels]
            if kind == "counter":
                self.families[name] = self._counter_cls(name=PREFIX + name, documentation=doc, labelnames=names)
            else:
                self.families[name] = self._gauge_cls(name=PREFIX + name, documentation=doc, labelnames=names,
                                                      multiprocess_mode="mostrecent")  # fmt: skip

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for key, n in transfer_stats_data.get("counters", {}).items():
            name, *labels = key.split(SEP)
            self.families[name].labels(*engine, *labels).inc(n)
        for key, value in transfer_stats_data.get("gauges", {}).items():
            name, *labels = key.split(SEP)
            self.families[name].labels(*engine, *labels).set(value)
