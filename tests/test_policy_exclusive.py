"""Exclusive L1/L2 (`write_back` with `l2_exclusive`): L2 holds no copy of
what L1 holds, so the cache holds L1 + L2 pages of content instead of L2.

Scenario tests drive a real cache (`make_cache`, invariant checks after every
call) and comment the state after each step: a load gives up the node's L2
copy once it is done, L1 eviction backs the node up again and the bytes come
back intact (a node keeps its L2 copy while a request holds it), and an
eviction that needs pages still being backed up waits for them (`settle` inside the allocation) instead of rejecting the request. The
random protocol machine and seeded stress of test_cache_stateful cover
`l2_exclusive` too (invariants after every step, both CP ranks alike). The
replay tests check that the mode pays on real workloads, with integrity.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from typing import Any

import numpy as np
import pytest

from conftest import Faults, evict_all_l1, expected_bytes, fill_pattern, land, run_request, tokens_of
from hicache_cp.config import Config, WritePolicy
from hicache_cp.errors import ConfigError
from hicache_harness.replay import command as replay
from hicache_cp.io.base import Direction
from hicache_cp.ops import LoadState
from hicache_cp.radix import HostState


def test_l2_exclusive_needs_write_back() -> None:
    with pytest.raises(ConfigError, match="l2_exclusive needs write_policy = write_back"):
        Config(l2_exclusive=True)
    with pytest.raises(ConfigError, match="l2_exclusive: expected true or false"):
        Config(l2_exclusive="yes", write_policy=WritePolicy.WRITE_BACK)  # type: ignore[arg-type]
    cfg = Config.load(overrides={"write_policy": "write_back", "l2_exclusive": "true"})  # as `--set` passes it
    assert cfg.l2_exclusive is True and cfg.write_policy is WritePolicy.WRITE_BACK
    assert Config().l2_exclusive is False


def _assert_bytes(cache: Any, tokens: np.ndarray, device_pages: np.ndarray) -> None:
    for p in cache.layout.parts:
        for layer in p.layer_ids:
            view = cache.device_pool.layer_view(p.part, p.slot(layer))
            for i, page in enumerate(device_pages):
                assert np.array_equal(view[page], expected_bytes(tokens, i, p.part, layer, p.page_bytes))


def test_a_load_gives_up_the_l2_copy_and_eviction_backs_it_up_again(make_cache) -> None:
    cache = make_cache(write_policy=WritePolicy.WRITE_BACK, l2_exclusive=True)
    host = cache.host_pool.allocator
    tokens = tokens_of(1, 2, 3)
    a = run_request(cache, tokens, write=fill_pattern)
    node = a.node
    assert node is not None and node.host_state is HostState.NONE and host.used_pages == 0  # L1 only
    evict_all_l1(cache)  # write_back: a backup starts, the node stays in L1 until it commits
    land(cache)
    evict_all_l1(cache)
    assert not node.on_device and node.host_visible and host.used_pages == 3  # L2 only
    b = run_request(cache, tokens)
    assert b.load is not None and b.load.state is LoadState.DONE
    # The load is done: L1 holds the bytes, the L2 copy is gone (no duplicate).
    assert node.on_device and node.host_state is HostState.NONE and host.used_pages == 0
    assert node.device_pages is not None
    _assert_bytes(cache, tokens, node.device_pages)
    evict_all_l1(cache)  # backed up again on its way out of L1
    land(cache)
    evict_all_l1(cache)
    assert not node.on_device and node.host_visible and host.used_pages == 3
    c = run_request(cache, tokens)
    assert c.load is not None and c.load.state is LoadState.DONE and node.device_pages is not None
    _assert_bytes(cache, tokens, node.device_pages)
    assert cache.metrics.evictions_l2 == 0  # the L2 copies left by loads are not evictions


def test_a_held_node_keeps_its_l2_copy_until_released(make_cache) -> None:
    # A request holding a node may read its committed L2 pages (a PD transfer
    # does): the copy goes only once nobody holds the node.
    cache = make_cache(write_policy=WritePolicy.WRITE_BACK, l2_exclusive=True)
    tokens = tokens_of(1, 2, 3)
    a = run_request(cache, tokens, write=fill_pattern)
    evict_all_l1(cache)
    land(cache)
    evict_all_l1(cache)
    b = run_request(cache, tokens, stop_after="poll")  # load done, b still holds the node
    node = a.node
    assert b.load is not None and b.load.state is LoadState.DONE and node is not None
    cache.ensure_free()
    assert node.on_device and node.host_visible and node.lock_ref > 0  # held: both copies stay
    b.release()
    cache.ensure_free()
    assert node.on_device and node.host_state is HostState.NONE and cache.host_pool.allocator.used_pages == 0


def test_without_exclusive_a_load_keeps_the_l2_copy(make_cache) -> None:
    cache = make_cache(write_policy=WritePolicy.WRITE_BACK)
    tokens = tokens_of(1, 2, 3)
    a = run_request(cache, tokens, write=fill_pattern)
    evict_all_l1(cache)
    land(cache)
    evict_all_l1(cache)
    run_request(cache, tokens)
    assert a.node is not None and a.node.on_device and a.node.host_visible  # L1 and L2 both hold it


def test_eviction_waits_for_victim_backups_instead_of_rejecting(make_cache) -> None:
    # L1 of 8 pages full of nodes that exist in L1 only (write_back): a new
    # request of 4 pages needs victims whose backups are still to be copied.
    cache = make_cache(write_policy=WritePolicy.WRITE_BACK, l2_exclusive=True, l1_pages=9, host_pages=16)
    l1 = cache.device_pool.allocator
    for first in (10, 20):
        run_request(cache, tokens_of(first, first + 1, first + 2, first + 3), write=fill_pattern)
    assert l1.free_pages == 0 and cache.host_pool.allocator.used_pages == 0
    r = run_request(cache, tokens_of(30, 31, 32, 33), write=fill_pattern)
    # The allocation backed up the least recently used node, waited for its
    # copy (an agreed poll), evicted it, and served the request.
    assert r.new is not None and len(r.new) == 4
    assert cache.metrics.backups_all_layer == 1 and cache.metrics.l1_alloc_failures == 0
    old = run_request(cache, tokens_of(10, 11, 12, 13))
    assert old.m is not None and old.m.host_len == 4  # the victim is an L2 hit, not lost
    assert old.load is not None and old.load.state is LoadState.DONE and old.node is not None
    _assert_bytes(cache, tokens_of(10, 11, 12, 13), old.load.device_pages)


def test_failing_victim_backups_fail_the_allocation_instead_of_looping(make_cache) -> None:
    # Every D2H copy fails: the victims' backups abort, a round frees nothing,
    # and the allocation gives up (a request the caller must not serve).
    faults = Faults()
    cache = make_cache(write_policy=WritePolicy.WRITE_BACK, l2_exclusive=True, l1_pages=9, host_pages=16, fault=faults)
    for first in (10, 20):
        run_request(cache, tokens_of(first, first + 1, first + 2, first + 3), write=fill_pattern)
    faults.fail_direction = Direction.D2H
    faults.fail_next = 10**6
    r = run_request(cache, tokens_of(30, 31, 32, 33), stop_after="match")
    assert cache.alloc_device(4, 0) is None
    assert cache.metrics.backups_aborted >= 1 and cache.metrics.l1_alloc_failures == 1
    r.release()
    cache.check_invariants()


# ---- replays: integrity, and the capacity it buys -------------------------------------------------


def _replay(*argv: str) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    replay.add_arguments(p)
    with contextlib.redirect_stderr(io.StringIO()):
        return replay.replay(p.parse_args([*argv, "--device", "cpu"]))


EXCLUSIVE = ("--write-policy", "write_back", "--set", "l2_exclusive=true")


@pytest.mark.parametrize("fraction", ["0.1", "0.25"])
def test_exclusive_lru_not_below_write_through_lru_on_the_embedded_workload(fraction: str) -> None:
    lru = _replay("--l2-fraction", fraction, "--policy", "lru", "--no-verify")
    mine = _replay("--l2-fraction", fraction, "--policy", "lru", *EXCLUSIVE)
    assert mine["integrity_mismatches"] == 0 and mine["integrity_checked_pages"] > 0
    assert mine["rejected_requests"] == 0
    assert mine["hit_rate"] >= lru["hit_rate"]


def test_exclusive_cp2_ranks_decide_alike() -> None:
    # Evictions that wait for backups poll inside the allocation: both ranks
    # must take that collective at the same step (combine_reports raises
    # ConsistencyError if any replicated decision diverged).
    two = _replay("--limit", "120", "--l2-fraction", "0.1", "--policy", "reuse_lru", "--cp-size", "2", *EXCLUSIVE)
    assert two["integrity_mismatches"] == 0 and two["integrity_checked_pages"] > 0 and two["rejected_requests"] == 0
    assert [r["collectives"] for r in two["per_rank"]] == [two["per_rank"][0]["collectives"]] * 2
