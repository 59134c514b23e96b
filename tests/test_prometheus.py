"""The Prometheus exporter, scraped over real HTTP on 127.0.0.1."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest

from conftest import tiny_config
from hicache_cp.cache import HiCache
from hicache_harness.engines.synthetic import ReferenceServer
from hicache_harness.trace import request_tokens
from hicache_harness.workload import default_workload

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from hicache_cp.prometheus import start_exporter  # noqa: E402


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_scrape_matches_the_cache() -> None:
    cache = HiCache(tiny_config(l1_pages=64, host_pages=128, debug_checks=False))
    exporter = start_exporter(cache, port=0)
    try:
        assert exporter.addr == "127.0.0.1"
        server = ReferenceServer(cache)
        for req in default_workload(seed=1)[:40]:
            server.serve(req.index, request_tokens(req, 16))
        cache.drain()
        stats = cache.stats()
        got = _scrape(exporter.port)
        r = ("rank", "0")
        assert got[("hicache_prompt_tokens_total", (r,))] == stats["prompt_tokens"] > 0
        assert got[("hicache_hit_tokens_total", (r, ("tier", "l2")))] == stats["l2_hit_tokens"] > 0
        assert got[("hicache_hit_tokens_total", (r, ("tier", "l1")))] == stats["l1_hit_tokens"]
        assert got[("hicache_bytes_total", (("direction", "d2h"), r, ("tier", "l2")))] == stats["bytes_d2h"] > 0
        assert got[("hicache_bytes_total", (("direction", "h2d"), r, ("tier", "l2")))] == stats["bytes_h2d"] > 0
        assert got[("hicache_evicted_pages_total", (r, ("tier", "l2")))] == stats["evictions_l2"]
        assert got[("hicache_backups_total", (("outcome", "committed"), r))] == stats["backups_committed"]
        assert got[("hicache_pool_pages", (r, ("state", "capacity"), ("tier", "l2")))] == stats["l2_capacity_pages"]
        assert got[("hicache_inflight_ops", (("kind", "backup"), r))] == 0
        # Histograms: every committed backup was timed, buckets are cumulative.
        count = got[("hicache_decision_latency_seconds_count", (("kind", "backup"), r))]
        assert count == stats["backups_committed"]
        inf = got[("hicache_decision_latency_seconds_bucket", (("kind", "backup"), ("le", "+Inf"), r))]
        assert inf == count
        assert got[("hicache_copy_latency_seconds_count", (("direction", "d2h"), r))] > 0
    finally:
        exporter.stop()
        cache.close()


def test_integrity_metrics_count_checks_and_failures() -> None:
    """Checked pages and failed units, by tier and part, as the library counted them."""
    from hicache_cp.layout import Part

    cache = HiCache(tiny_config(l1_pages=64, host_pages=64))
    exporter = start_exporter(cache, port=0)
    try:
        server = ReferenceServer(cache)
        prompt = np.arange(6 * 16, dtype=np.int64)
        server.serve(0, prompt)
        cache.evict_device()
        server.serve(1, prompt)  # a clean L2 load: 6 pages checked
        cache.evict_device()
        page = np.concatenate([n.host_pages for n in cache.tree.match(prompt)])[0]
        cache.host_pool.layer_view(Part.DRAFT_STATE, 0)[page, 0] ^= 1
        server.serve(2, prompt)  # fails its check
        got = _scrape(exporter.port)
        r = ("rank", "0")
        assert got[("hicache_integrity_checked_pages_total", (r, ("tier", "l2")))] == cache.stats()["verified_pages"] >= 6
        assert got[("hicache_integrity_failures_total", (("part", "draft_state"), r, ("tier", "l2")))] == 1
        assert got[("hicache_integrity_dropped_pages_total", (r,))] == 6
    finally:
        exporter.stop()
        cache.close()


def test_bad_port_is_refused() -> None:
    from hicache_cp.errors import ConfigError

    cache = HiCache(tiny_config())
    try:
        with pytest.raises(ConfigError, match="port"):
            start_exporter(cache, port=70000)
    finally:
        cache.close()


def test_replay_serves_metrics_on_loopback(monkeypatch) -> None:
    """`replay --metrics-port` starts the endpoint for the run, bound to
    127.0.0.1, and a scrape during the run sees the cache's counters."""
    import socket

    from hicache_cp import prometheus
    from hicache_harness.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scraped: list[dict] = []
    real_start = prometheus.start_exporter

    def start_and_keep(cache, port, addr):  # type: ignore[no-untyped-def]
        exporter = real_start(cache, port, addr)
        real_stop = exporter.stop

        def stop() -> None:  # scrape once, over HTTP, just before the run ends
            scraped.append(_scrape(exporter.port))
            real_stop()

        exporter.stop = stop  # type: ignore[method-assign]
        assert exporter.server.server_address[0] == "127.0.0.1"
        return exporter

    monkeypatch.setattr(prometheus, "start_exporter", start_and_keep)
    assert main(["replay", "--limit", "30", "--metrics-port", str(port)]) == 0
    assert scraped and scraped[0][("hicache_prompt_tokens_total", (("rank", "0"),))] > 0


def test_every_family_is_served_under_each_engines_naming(monkeypatch) -> None:
    """Per-tier families, events and the integrity counters (once the cache reports
    them) are all served, named after the engine's convention."""
    from hicache_cp.events import EventLog
    from hicache_cp.prometheus import NAMINGS, metric_names

    cache = HiCache(tiny_config(l1_pages=32, host_pages=16, debug_checks=False), events=EventLog())
    server = ReferenceServer(cache)
    for req in default_workload(seed=2)[:30]:
        server.serve(req.index, request_tokens(req, 16))
    cache.drain()
    real_stats = cache.stats
    integrity = {"checked_pages": {"l2": 40, "l3": 3}, "failures": {"l2": {"draft_kv": 1}}}
    monkeypatch.setattr(cache, "stats", lambda: {**real_stats(), "integrity": integrity})
    try:
        for naming, prefix in NAMINGS.items():
            exporter = start_exporter(cache, port=0, naming=naming)
            try:
                got = _scrape(exporter.port)
            finally:
                exporter.stop()
            assert {name for name, _ in got} == set(metric_names(naming))
            r = ("rank", "0")
            assert got[(f"{prefix}kv_events_blocks_total", (("kind", "stored"), ("medium", "host"), r))] == \
                cache.events.blocks[("host", "stored")] > 0
            assert got[(f"{prefix}evicted_pages_total", (r, ("tier", "l1")))] == cache.stats()["evictions_l1"] > 0
            assert got[(f"{prefix}integrity_failures_total", (("part", "draft_kv"), r, ("tier", "l2")))] == 1
            assert got[(f"{prefix}integrity_checked_pages_total", (r, ("tier", "l3")))] == 3
    finally:
        cache.close()


def test_an_unknown_naming_is_refused() -> None:
    from hicache_cp.errors import ConfigError

    cache = HiCache(tiny_config())
    try:
        with pytest.raises(ConfigError, match="naming"):
            start_exporter(cache, port=0, naming="trtllm")
    finally:
        cache.close()
