"""The SGLang plug-in's Prometheus endpoint (`HICACHE_CP_METRICS_PORT`), scraped over HTTP.

A CPU server on SGLang 0.5.23's real classes (`hicache_harness.sglang.server`)
with the variable set serves `sglang:hicache_*` metrics from its scheduler
process: an L2 hit shows in the scrape as it shows in the cache's stats; after
SGLang's `flush_cache` (the plug-in's `reset`) the endpoint reads the new
cache; `close` frees the port. A bad value is refused before anything is built.
"""

from __future__ import annotations

import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="sglang not installed (scripts/install_sglang.sh)")
pytest.importorskip("prometheus_client", reason="the metrics extra is not installed")

from hicache_cp import ConfigError  # noqa: E402
from hicache_harness.sglang.env import import_sglang  # noqa: E402
from hicache_harness.sglang.server import SGLangPrefillServer, ServerSpec  # noqa: E402

import_sglang()
from test_sglang_radix import PAGE, evict_device, prompt, serve, server_env  # noqa: E402

pytestmark = pytest.mark.slow


def _server(tmp_path: Path, port: str) -> SGLangPrefillServer:
    spec = ServerSpec(device="cpu")
    env = {**server_env(64, spec), "HICACHE_CP_METRICS_PORT": port}
    return SGLangPrefillServer(spec, tmp_path / "s", tree_cache_kwargs={"env": env})


def _scrape(port: int) -> dict[str, float]:
    """`name{labels}` -> value of every sample the endpoint serves."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(r"([^#\s][^\s]*)\s+(\S+)", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_the_endpoint_serves_the_caches_metrics_under_sglangs_names(tmp_path: Path) -> None:
    s = _server(tmp_path, "0")
    try:
        exporter = s.tree_cache.exporter
        assert exporter is not None and exporter.addr == "127.0.0.1" and exporter.port > 0
        tokens = prompt(3, 5)
        serve(s, tokens)
        evict_device(s)
        r = serve(s, tokens)
        assert r.host_hit_length == 5 * PAGE
        stats = s.tree_cache.cache.stats()
        got = _scrape(exporter.port)
        assert got['sglang:hicache_hit_tokens_total{rank="0",tier="l2"}'] == stats["l2_hit_tokens"] == 5 * PAGE
        assert got['sglang:hicache_bytes_total{direction="h2d",rank="0",tier="l2"}'] == stats["bytes_h2d"] > 0
        assert got['sglang:hicache_integrity_checked_pages_total{rank="0",tier="l2"}'] > 0
        # SGLang matched each request more than once before admitting it: counted once each
        assert got['sglang:hicache_prompt_tokens_total{rank="0"}'] == 2 * 5 * PAGE
        assert got['sglang:hicache_miss_tokens_total{rank="0"}'] == 5 * PAGE
        serve(s, tokens)  # now a hit in SGLang's device tree: L1 in the plug-in's families
        got = _scrape(exporter.port)
        assert got['sglang:hicache_hit_tokens_total{rank="0",tier="l1"}'] == 5 * PAGE
        assert got['sglang:hicache_hit_tokens_total{rank="0",tier="l2"}'] == 5 * PAGE
        assert not any(k.startswith("hicache_") for k in got), "default names beside SGLang's"

        s.tree_cache.reset()  # SGLang's flush_cache: a new cache behind the same endpoint
        assert s.tree_cache.exporter is exporter
        after = _scrape(exporter.port)
        assert after['sglang:hicache_hit_tokens_total{rank="0",tier="l2"}'] == 0
        assert after['sglang:hicache_pool_pages{rank="0",state="used",tier="l2"}'] == 0
    finally:
        s.close()
    with pytest.raises(urllib.error.URLError):
        _scrape(exporter.port)


@pytest.mark.parametrize("value", ["abc", "-1", "65536", "٣"])
def test_a_value_that_is_not_a_port_is_refused_before_anything_is_built(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match="HICACHE_CP_METRICS_PORT"):
        _server(tmp_path, value)


def test_a_port_in_use_is_a_config_error_naming_the_variable(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"HICACHE_CP_METRICS_PORT={port}: rank 0 cannot serve metrics"):
            _server(tmp_path, str(port))
