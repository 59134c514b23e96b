"""The vLLM connector's metrics through vLLM's own path, with vLLM's own classes.

vLLM's real `Scheduler` (`test_vllm_bench`) asks the scheduler-role connector
and each worker for `get_kv_connector_stats()` every step; vLLM's
`KVOutputAggregator` sums the workers' and the scheduler adds its own into
the step's `SchedulerStats`. Those payloads are fed here, as vLLM's API
server does, to vLLM's `KVConnectorProm` (its /metrics families, on a
registry of the test's) and `KVConnectorLogging` (its periodic log line).
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.metrics", reason="vLLM not installed")
prometheus_client = pytest.importorskip("prometheus_client")

import test_vllm_bench as H  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm  # noqa: E402

P = list(range(100, 185))  # 85 tokens: 5 whole pages of 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return H.write_model_dir(tmp_path_factory.mktemp("tiny-deepseek"))


def _payloads(bench: H.Bench) -> list[dict]:
    """Every step's `kv_connector_stats` payload from now on, as the scheduler hands them out."""
    out: list[dict] = []
    update = bench.sched.update_from_output

    def update_and_keep(so, mro):  # type: ignore[no-untyped-def]
        engine_outputs = update(so, mro)
        for eco in engine_outputs.values():
            stats = eco.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                out.append(stats.kv_connector_stats)
        return engine_outputs

    bench.sched.update_from_output = update_and_keep  # type: ignore[method-assign]
    return out


def _sample(registry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})
    assert value is not None, f"no sample {name}{labels}"
    return value


def test_vllm_serves_the_connectors_families_once_per_request(model_dir) -> None:
    bench = H.make_bench(model_dir, workers=2)
    try:
        payloads = _payloads(bench)
        bench.add(P)
        bench.run()
        bench.drop_vllm_prefix_cache()
        bench.add(P)
        (hit,) = bench.run()
        assert hit.loads == [("r2", 0, 5)]
        for _ in range(3):  # a few steps with nothing scheduled: their reports carry the last decisions
            bench.step()
        stats = bench.cache.stats()
        checked = sum(e.integrity.snapshot()[0].get("l2", 0) for e in bench.engines())
    finally:
        bench.close()

    registry = prometheus_client.CollectorRegistry()

    class Prom(KVConnectorProm):
        _counter_cls = functools.partial(prometheus_client.Counter, registry=registry)
        _gauge_cls = functools.partial(prometheus_client.Gauge, registry=registry)
        _histogram_cls = functools.partial(prometheus_client.Histogram, registry=registry)

    vllm_config = H.vllm_config(model_dir, bench.sched.vllm_config.kv_transfer_config)
    prom = Prom(vllm_config, ["model_name", "engine"], {0: ["m", "0"]})
    logging = KVConnectorLogging(vllm_config.kv_transfer_config)
    assert payloads, "vLLM carried no connector stats"
    for payload in payloads:
        prom.observe(payload, 0)
        logging.observe(payload)

    # vLLM looked each request up more than once; each counts once
    assert _sample(registry, "vllm:hicache_prompt_tokens_total") == 2 * len(P)
    assert _sample(registry, "vllm:hicache_hit_tokens_total", tier="l2") == 5 * 16
    assert _sample(registry, "vllm:hicache_bytes_total", tier="l2", direction="h2d") == stats["bytes_h2d"] > 0
    assert _sample(registry, "vllm:hicache_bytes_total", tier="l2", direction="d2h") == stats["bytes_d2h"] > 0
    assert _sample(registry, "vllm:hicache_backups_total", outcome="committed") == stats["backups_committed"] == 1
    # the workers' restore checks: every page each of them loaded
    pages_checked = checked // sum(p.num_slots for p in bench.cache.layout.parts)
    assert _sample(registry, "vllm:hicache_integrity_checked_pages_total", tier="l2") == pages_checked == 2 * 5
    used = stats["l2_capacity_pages"] - stats["l2_free_pages"]
    assert _sample(registry, "vllm:hicache_pool_pages", tier="l2", state="used") == used > 0
    assert registry.get_sample_value("vllm:hicache_pool_pages", {"model_name": "m", "engine": "0", "tier": "l1",
                                                                 "state": "used"}) is None  # vLLM's own  # fmt: skip
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and "hit_tokens_l2=80" in lines[0], lines


def test_a_report_holds_what_changed_since_the_last_one() -> None:
    from hicache_cp.integrations.vllm.stats import HiCacheStats, Reporter

    r = Reporter()
    first = r.report({"hit_tokens": {("l2",): 32}, "pool_pages": {("l2", "used"): 4}})
    assert first is not None and first.data == {"counters": {"hit_tokens|l2": 32}, "gauges": {"pool_pages|l2|used": 4}}
    assert r.report({"hit_tokens": {("l2",): 32}, "pool_pages": {("l2", "used"): 4}}) is None  # nothing changed
    after_reset = r.report({"hit_tokens": {("l2",): 16}, "pool_pages": {("l2", "used"): 1}})  # a new cache
    assert after_reset is not None and after_reset.data["counters"] == {"hit_tokens|l2": 16}
    both = HiCacheStats({"counters": {"bytes|l2|h2d": 5}, "gauges": {}}).aggregate(after_reset)
    assert both.data["counters"] == {"bytes|l2|h2d": 5, "hit_tokens|l2": 16}
    assert both.reduce() == {"bytes_l2_h2d": 5, "hit_tokens_l2": 16}
