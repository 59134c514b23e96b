"""The node tier across real rank processes (gloo on CPU) sharing one segment.

    two / four ranks   the replay with one copy for the node against today's private copy
                       per rank: the same hits, host bytes and D2H bytes per rank 1/N,
                       every reused byte checked
    restart            the replay killed with SIGKILL during a request's backups and
                       restarted: the continuation's hit rate within 0.01 of an
                       uninterrupted run's, 0 mismatches (TP replicas; CP ranks with
                       one copy each)
    rank killed        one rank dies mid-backup: after a restart nothing of that backup
                       is visible and no page is leaked

Every test names its segment after its pid and checks /dev/shm is clean afterwards.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hicache_cp.cache import HiCache
from hicache_harness.engines import crash
from hicache_harness.engines.synthetic import ReferenceServer
from hicache_harness.launch import RankContext, RankFailed, spawn_ranks
from hicache_harness.replay import command as replay
from hicache_harness.trace import request_tokens
from hicache_harness.workload import default_workload
from hicache_cp.node.geometry import NodeGeometry
from hostmem.segment import find_segment

from conftest import PAGE, tiny_config

TIMEOUT_S = 300.0



def _replay(*argv: str) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    replay.add_arguments(p)
    report = replay.replay(p.parse_args([*argv, "--device", "cpu"]))
    return json.loads(json.dumps(report))  # what --json writes


def _metadata_bytes(report: dict[str, Any]) -> int:
    """Header, directory, tokens and checksums of the run's segment (resident, shared),
    plus one base page per data region (each region's resident end rounds up to one)."""
    from hicache_cp.config import Config

    c = Config.from_dict({k: v["value"] for k, v in report["config"].items() if k != "l3"})
    layout = c.layout()
    g = NodeGeometry(layout, c.model, layout.split_budget(int(c.host_budget_bytes)).pages, 1, 1,
                     report["stats"]["node_sharing"], align=1)  # fmt: skip
    return -(-g.data_offset // 4096) * 4096 + 4096 * len(layout.parts)  # (align 1: the data follow the checksums)


def _compare_with_today(today: dict[str, Any], node: dict[str, Any], ranks: int) -> None:
    """Same decisions and hits; 1/N host and D2H bytes per rank; every byte checked.

    `today` is one rank with its own L2: what each of today's TP ranks does (they
    are replicas: the same decisions, the same pool, the same copies)."""
    for key in ("hit_rate", "l1_hit_tokens", "l2_hit_tokens", "backups_committed", "evictions_l1", "evictions_l2"):
        assert node[key] == today[key], key
    for rep in (today, node):
        assert rep["integrity_mismatches"] == 0 and rep["integrity_checked_units"] == rep["integrity_expected_units"] > 0
    assert len(node["per_rank"]) == ranks
    meta = _metadata_bytes(node)
    for mine in node["per_rank"]:
        assert mine["host_bytes"] * ranks == today["host_bytes"]  # this rank's share of the one copy
        assert mine["host_pss_bytes"] <= today["host_pss_bytes"] / ranks + meta  # measured: its resident share
        assert mine["integrity_checked_units"] == today["integrity_checked_units"]  # every rank checks every reuse
    assert sum(p["host_pss_bytes"] for p in node["per_rank"]) <= today["host_pss_bytes"] + meta
    assert node["bytes_d2h"] == today["bytes_d2h"]  # the node copies each page once, as one rank did
    for mine in node["per_rank"]:  # and each rank carries about 1/N of it
        assert abs(mine["bytes_d2h"] - today["bytes_d2h"] / ranks) <= 0.25 * today["bytes_d2h"] / ranks


def test_two_ranks_share_one_copy_and_a_replay_killed_with_sigkill_restarts_with_its_hit_rate(seg_name: str) -> None:
    common = ("--limit", "90", "--seed", "5")
    today = _replay(*common)
    node = (*common, "--node-ranks", "2", "--node-segment", seg_name, "--set", "node_drop_on_close=true")
    uninterrupted = _replay(*node, "--report-from", "45")
    _compare_with_today(today, uninterrupted, 2)
    assert find_segment(seg_name) is None  # dropped at the orderly close that asked for it
    restarted = _replay(*node, "--restart-at", "45")
    info = restarted["restart"]
    assert info["node_adopted"] and info["node_adopted_pages"] > 0 and info["node_verify_failures"] == 0
    assert info["node_verified_pages"] > 0  # adopted pages were checked before they served
    a, b = uninterrupted["continuation"], restarted["continuation"]
    assert a["from_request"] == b["from_request"] == 45 and a["requests"] == b["requests"] == 45
    assert abs(a["hit_rate"] - b["hit_rate"]) <= 0.01, (a, b)
    assert restarted["integrity_mismatches"] == 0
    assert restarted["integrity_checked_units"] == restarted["integrity_expected_units"] > 0
    assert find_segment(seg_name) is None


@pytest.mark.slow
def test_four_ranks_share_one_copy_with_todays_hits(seg_name: str) -> None:
    common = ("--limit", "48", "--seed", "7")
    today = _replay(*common)
    node = _replay(*common, "--node-ranks", "4", "--node-segment", seg_name, "--set", "node_drop_on_close=true")
    _compare_with_today(today, node, 4)
    assert find_segment(seg_name) is None


@pytest.mark.slow
def test_cp_ranks_keep_per_rank_copies_in_one_segment_across_a_restart(seg_name: str) -> None:
    """Under CP each rank holds other pages: one copy per rank in the segment, adopted alike."""
    common = ("--limit", "90", "--seed", "5", "--cp-size", "2", "--node-segment", seg_name,
              "--set", "node_drop_on_close=true")  # fmt: skip
    uninterrupted = _replay(*common, "--report-from", "45")
    assert uninterrupted["stats"]["node_sharing"] == "per_rank" and uninterrupted["stats"]["node_copies"] == 2
    restarted = _replay(*common, "--restart-at", "45")
    assert restarted["restart"]["node_adopted"] and restarted["restart"]["node_adopted_pages"] > 0
    assert abs(uninterrupted["continuation"]["hit_rate"] - restarted["continuation"]["hit_rate"]) <= 0.01
    assert restarted["integrity_mismatches"] == 0
    assert restarted["integrity_checked_units"] == restarted["integrity_expected_units"] > 0
    assert find_segment(seg_name) is None


# ---- one rank killed in the middle of a backup ------------------------------------------------------


def _serve_then_die(ctx: RankContext, name: str, out: str) -> None:
    """Serve 10 requests; on the 11th rank 1 dies after its layer hooks (its copies in
    flight) and rank 0 goes on into the poll, whose collective fails. Rank 0 writes
    down what the journal held and the pending backup's pages first."""
    cache = HiCache(tiny_config(host_pages=160, l1_pages=48, node_segment=name), agreement=ctx.agreement)
    server = ReferenceServer(cache)
    for r in default_workload(seed=11)[:10]:
        server.serve(r.index, request_tokens(r, PAGE))
    cache.drain()
    tokens = np.arange(10**6, 10**6 + 6 * PAGE, dtype=np.int64)  # a new prompt: six pages to compute and back up
    if ctx.rank == 1:
        server.before_insert = crash
    else:
        def note() -> None:
            pending = [op.host_pages.tolist() for op in cache.in_flight()[0]]
            committed = cache._node.journal.committed_pages().tolist()  # type: ignore[union-attr]
            Path(out).write_text(json.dumps({"committed": committed, "pending": pending, "tokens": tokens.tolist()}))

        server.before_insert = note
    server.serve(10, tokens)
    raise AssertionError(f"rank {ctx.rank} finished a request whose peer died")


def test_a_rank_killed_mid_backup_leaves_nothing_visible_and_nothing_leaked(seg_name: str, tmp_path: Path) -> None:
    out = tmp_path / "before.json"
    with pytest.raises(RankFailed):
        spawn_ranks(_serve_then_die, 2, (seg_name, str(out)), timeout_s=TIMEOUT_S, backend="gloo")
    before = json.loads(out.read_text())
    pending = {p for op in before["pending"] for p in op}
    assert pending  # the request's backup was in flight when rank 1 died
    cache = HiCache(tiny_config(host_pages=160, l1_pages=48, node_segment=seg_name, node_drop_on_close=True))
    try:
        assert cache.stats()["node_decision"] == "adopt" and cache.stats()["node_adopted"]
        adopted = {int(p) for n in cache.tree.nodes() for p in n.host_pages}  # type: ignore[union-attr]
        assert adopted == set(before["committed"]) and not adopted & pending
        assert cache.host_pool.allocator.used_pages == len(adopted)  # nothing leaked
        cache.check_invariants()
        m = cache.match_prefix(np.array(before["tokens"], np.int64))
        visible = {int(p) for n in m.host_nodes for p in n.host_pages}  # type: ignore[union-attr]
        assert not visible & pending
        cache.release(m.last_node)
    finally:
        cache.close()
    assert find_segment(seg_name) is None
