"""The node tier inside one cache (one process): a restart adopts what was committed and
nothing else, every adopted page is checked before its first use, another layout starts
clean, and the segment goes when asked.

A "crash" here is a cache whose process state is dropped without deciding what is in
flight: its copies are waited for (the CPU engine's threads), its segment unmapped and
its locks released, as the kernel does for a killed process; nothing else runs. The
multi-process tests (tests/test_node_ranks.py) kill real processes.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import numpy as np
import pytest

from hicache_cp.cache import HiCache
from hicache_harness.engines.synthetic import ReferenceServer
from hicache_harness.trace import request_tokens
from hicache_harness.workload import default_workload
from hicache_cp.layout import Model
from hostmem.segment import find_segment

from conftest import PAGE, tiny_config

REQUESTS = default_workload(seed=3)[:48]



def node_cache(name: str, **over: Any) -> HiCache:
    values: dict[str, Any] = dict(host_pages=160, l1_pages=48, node_segment=name)
    values.update(over)
    return HiCache(tiny_config(**values))


def serve(cache: HiCache, requests: list[Any]) -> ReferenceServer:
    server = ReferenceServer(cache)
    for r in requests:
        server.serve(r.index, request_tokens(r, PAGE))
    cache.drain()
    cache.check_invariants()
    return server


def crash(cache: HiCache) -> None:
    """Drop a cache as a killed process would: nothing decided, no journal write, the
    segment unmapped (the CPU engine's threads are joined so they stop writing)."""
    cache.engine.close()
    cache.host_pool.close()
    cache._node.segment.segment.close()  # type: ignore[union-attr]


def test_a_restart_adopts_the_committed_pages_and_serves_them_checked(seg_name: str) -> None:
    first = node_cache(seg_name)
    serve(first, REQUESTS[:24])
    committed = first.stats()["node_journal_commits"] - first.stats()["node_journal_releases"]
    held = first.host_pool.allocator.used_pages
    first.close()
    again = node_cache(seg_name)
    s = again.stats()
    assert s["node_decision"] == "adopt" and s["node_adopted_pages"] == held > 0
    assert committed >= held  # a page committed twice counts twice
    server = serve(again, REQUESTS[24:])
    s = again.stats()
    assert s["l2_hit_tokens"] > 0 and s["node_verified_pages"] > 0 and s["node_verify_failures"] == 0
    t = server.integrity
    assert t.mismatches == 0 and t.checked_units == t.expected_units > 0
    again.close()
    assert find_segment(seg_name) is not None
    gone = node_cache(seg_name, node_drop_on_close=True)
    gone.close()
    assert find_segment(seg_name) is None  # an orderly close that asked for it leaves nothing


def test_a_backup_pending_at_the_crash_is_never_adopted_and_leaks_nothing(seg_name: str) -> None:
    first = node_cache(seg_name)
    serve(first, REQUESTS[:12])
    before = set(first._node.journal.committed_pages().tolist())  # type: ignore[union-attr]
    tokens = np.arange(1000, 1000 + 5 * PAGE, dtype=np.int64)  # a new prefix: 5 pages to compute
    m = first.match_prefix(tokens)
    new = first.alloc_device(5, 0)
    bk = first.reserve_backup(new, 0)
    assert bk is not None
    for model in (Model.TARGET, Model.DRAFT):
        for layer in range(first.layout.num_layers(model)):
            first.on_layer_end(model, layer, [bk])  # every layer's copy submitted, nothing decided
    pending = set(bk.host_pages.tolist())
    crash(first)
    again = node_cache(seg_name)
    adopted = {int(p) for n in again.tree.nodes() for p in n.host_pages}  # type: ignore[union-attr]
    assert adopted == before and not adopted & pending
    assert again.host_pool.allocator.used_pages == len(before)  # nothing leaked
    m = again.match_prefix(tokens)
    assert m.matched_pages == 0  # nothing of the pending copy is visible
    again.release(m.last_node)
    again.check_invariants()
    again.close()
    del m
    node_cache(seg_name, node_drop_on_close=True).close()


def test_an_adopted_page_that_changed_is_caught_at_its_first_use(seg_name: str) -> None:
    """The restore checks catch it: the load that first reads the adopted copy fails its
    check, the request recomputes, and the copy leaves L2 and the journal."""
    first = node_cache(seg_name)
    serve(first, REQUESTS[:24])
    victim = max((n for n in first.tree.nodes() if n.host_pages is not None), key=lambda n: n.end_position)
    path, n = [], victim
    while n.parent is not None:
        path.append(n.tokens)
        n = n.parent
    tokens = np.concatenate(path[::-1])  # the victim's whole prefix
    bad = victim.first_position + victim.num_pages // 2
    page = int(victim.host_pages[bad - victim.first_position])  # type: ignore[index]
    first.host_pool.layer_view(first.layout.parts[0].part, 1)[page, 3] ^= 0xFF  # one byte, after the commit
    first.close()
    again = node_cache(seg_name)
    server = ReferenceServer(again)
    r = server.serve(0, tokens)  # the adopted copy matches, its load fails its check: recomputed
    again.drain()
    again.check_invariants()
    s = again.stats()
    assert r.l2_hit_pages > 0 and s["loads_aborted"] == 1 and s["node_verify_failures"] >= 1, s
    assert s["verify_failures_l2_target_kv"] == 1 and s["integrity_dropped_pages"] == r.l2_hit_pages  # the load's copies
    assert server.integrity.mismatches == 0 and server.integrity.checked_units == server.integrity.expected_units
    assert page not in again._node.journal.committed_pages()  # type: ignore[union-attr]
    again.close()
    node_cache(seg_name, node_drop_on_close=True, node_adopt=False).close()


def test_another_layout_starts_clean_with_one_info_line(seg_name: str, caplog: pytest.LogCaptureFixture) -> None:
    first = node_cache(seg_name)
    serve(first, REQUESTS[:8])
    first.close()
    caplog.set_level(logging.INFO, logger="hicache_cp.node.segment")
    other = node_cache(seg_name, page_size=32, host_pages=80)
    lines = [r.getMessage() for r in caplog.records if "not adopted" in r.getMessage()]
    assert len(lines) == 1 and "page_size 16 in the segment, 32 here" in lines[0]
    assert other.stats()["node_adopted_pages"] == 0 and other.host_pool.allocator.used_pages == 0
    other.close()
    caplog.clear()
    unchecked = node_cache(seg_name, page_size=32, host_pages=80, verify_restores="off", node_drop_on_close=True)
    assert unchecked.stats()["node_adopted_pages"] == 0
    assert any("not adopted" in r.getMessage() for r in caplog.records)
    unchecked.close()


def test_a_second_engine_cannot_take_a_segment_in_use(seg_name: str) -> None:
    from hostmem.segment import SegmentBusy

    first = node_cache(seg_name)
    with pytest.raises(SegmentBusy, match="in use"):
        node_cache(seg_name)
    first.close()
    node_cache(seg_name, node_drop_on_close=True).close()


def test_the_cli_lists_shows_and_drops_a_segment_but_not_one_in_use(seg_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    from hicache_harness.cli import main

    cache = node_cache(seg_name)
    serve(cache, REQUESTS[:6])
    assert main(["node-segment", "list", "--prefix", seg_name]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(seg_name) and "model tiny" in line and str(os.getpid()) in line  # mapped here
    assert main(["node-segment", "drop", seg_name]) == 2  # in use: refused
    assert "in use" in capsys.readouterr().err
    held = cache.host_pool.allocator.used_pages
    cache.close()
    assert main(["node-segment", "show", seg_name]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["committed_pages"] == held and shown["layout"]["page_size"] == PAGE and shown["users"] == []
    assert main(["node-segment", "drop", seg_name]) == 0 and find_segment(seg_name) is None
    assert main(["node-segment", "drop", seg_name]) == 2


def test_a_segment_in_another_directory_is_found_there(seg_name: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from hicache_harness.cli import main

    cache = node_cache(seg_name, node_segment_dir=str(tmp_path))
    serve(cache, REQUESTS[:4])
    assert cache._node.segment.path == str(tmp_path / seg_name) and find_segment(seg_name) is None  # type: ignore[union-attr]
    cache.close()
    again = node_cache(seg_name, node_segment_dir=str(tmp_path), node_drop_on_close=True)
    assert again.stats()["node_adopted"]
    again.close()
    assert not (tmp_path / seg_name).exists()
    with pytest.raises(Exception, match="node_segment_dir"):
        node_cache(seg_name, node_segment_dir=str(tmp_path / "missing"))
    assert main(["node-segment", "--dir", str(tmp_path), "list"]) == 0 and capsys.readouterr().out == ""
