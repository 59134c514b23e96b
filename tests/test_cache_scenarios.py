"""Scenario tests of the cache's state machines (backup, load-back, eviction).

Each test drives one story step by step and comments the state after each
step. The CPU copy engine runs copies on worker threads; `Faults` (conftest)
holds, delays or fails them so every intermediate state can be observed.
`debug_checks=True` runs `check_invariants()` inside every mutating call.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from hicache_cp.config import WritePolicy
from hicache_cp.errors import ConsistencyError, IllegalTransition
from hicache_cp.io.base import Direction
from hicache_cp.layout import Model, Part
from hicache_cp.ops import BackupOp, BackupState, LoadOp, LoadState
from hicache_cp.radix import HostState

from conftest import Faults, evict_all_l1, evict_all_l2, expected_bytes, fill_pattern, land, run_request, tokens_of


# ---- construction ------------------------------------------------------------------------


def test_engine_options_reach_the_io_backend_and_unknown_ones_are_refused(make_cache, monkeypatch) -> None:
    """`engine_options` go to the backend `io_backend` names (the fault hook of the
    cpu backend here); an option the backend lacks fails the construction, which
    closes the host pool it made."""
    from hicache_cp.cache import HiCache

    from conftest import tiny_config

    from hicache_cp.pools import HostPool

    faults = Faults()
    assert make_cache(l1_pages=8, host_pages=8, fault=faults).engine.fault is faults  # type: ignore[attr-defined]
    closed: list[HostPool] = []
    real_close = HostPool.close
    monkeypatch.setattr(HostPool, "close", lambda pool: (closed.append(pool), real_close(pool)))
    with pytest.raises(TypeError, match="worker_above"):
        HiCache(tiny_config(l1_pages=8, host_pages=8), engine_options={"worker_above": 4})
    assert len(closed) == 1  # the pinned pool it made is released, not left to the collector


# ---- backup ------------------------------------------------------------------------------


def test_backup_invisible_until_every_part_landed(make_cache) -> None:
    cache = make_cache(l1_pages=32, host_pages=32)
    l2 = cache.host_pool.allocator
    free0 = l2.free_pages
    r = run_request(cache, tokens_of(1, 2, 3), stop_after="reserve")
    bk = r.bk
    assert bk is not None
    # RESERVED: 3 host pages taken, nothing submitted, no node yet.
    assert bk.state is BackupState.RESERVED and l2.free_pages == free0 - 3
    assert not bk.inflight and not any(bk.submitted.values())

    r.target_layer(0)
    # WRITING: the first target hook submitted target_kv and target_state of layer 0 only.
    assert bk.state is BackupState.WRITING
    assert bk.submitted[Part.TARGET_KV] == {0} and bk.submitted[Part.TARGET_STATE] == {0}
    assert bk.submitted[Part.DRAFT_KV] == set() and bk.submitted[Part.DRAFT_STATE] == set()

    for layer in (1, 2, 3):
        r.target_layer(layer)
    node = r.insert()
    land(cache)
    # Every target layer landed, the draft has not run: still WRITING, node PENDING,
    # the host copy is invisible and not an L2 eviction candidate.
    assert bk.state is BackupState.WRITING
    assert bk.landed[Part.TARGET_KV] == {0, 1, 2, 3} and bk.landed[Part.TARGET_STATE] == {0, 2}
    assert node.host_state is HostState.PENDING and not node.host_visible
    assert node not in cache.tree.host_leaves and node not in cache.tree.device_leaves
    probe = cache.match_prefix(tokens_of(1, 2, 3))
    assert probe.host_len == 0 and probe.device_len == 3  # device hit only
    cache.release(probe.last_node)
    evict_all_l2(cache)  # nothing committed: nothing may be freed
    assert l2.free_pages == free0 - 3 and node.host_pages is not None

    r.draft_layer(0)
    # Draft submitted but not polled yet: still WRITING.
    assert bk.state is BackupState.WRITING and node.host_state is HostState.PENDING
    land(cache)
    # COMMITTED: every layer of every part landed; the host copy is visible.
    assert bk.state is BackupState.COMMITTED
    assert node.host_state is HostState.COMMITTED and node.backup is None
    assert node.host_parts == {p.part for p in cache.layout.parts}
    assert cache.in_flight() == ([], [])
    r.release()
    evict_all_l1(cache)
    # L1 copy gone, L2 copy stays: the next match is a host hit.
    assert node.device_pages is None and node.host_visible
    m = cache.match_prefix(tokens_of(1, 2, 3))
    assert m.device_len == 0 and m.host_len == 3 and m.host_nodes == [node]
    cache.release(m.last_node)


def test_layer_hooks_back_up_only_their_own_forward(make_cache) -> None:
    """Two forwards in flight: B's draft hook must not copy A's draft layer,
    which A has not written yet (the stress test's byte check found this)."""
    cache = make_cache(l1_pages=32, host_pages=32)
    a = run_request(cache, tokens_of(1, 2), stop_after="target", write=fill_pattern)
    b = run_request(cache, tokens_of(3, 4), stop_after="draft", write=fill_pattern)
    assert a.bk is not None and b.bk is not None
    assert b.bk.submitted[Part.DRAFT_KV] == {0}
    assert a.bk.submitted[Part.DRAFT_KV] == set(), "A's draft layer was copied before A wrote it"
    for layer in range(cache.layout.num_layers(Model.DRAFT)):
        a.draft_layer(layer, fill_pattern)
    for r in (a, b):
        r.insert()
    land(cache)
    for r in (a, b):
        assert r.node is not None and r.node.host_visible
        r.release()
    evict_all_l1(cache)
    # Both come back from L2 with exactly the bytes their forwards wrote.
    for toks in (tokens_of(1, 2), tokens_of(3, 4)):
        r = run_request(cache, toks, stop_after="poll")
        assert r.load is not None and r.load.state is LoadState.DONE
        for p in cache.layout.parts:
            for layer in p.layer_ids:
                view = cache.device_pool.layer_view(p.part, p.slot(layer))
                for i, page in enumerate(r.load.device_pages):
                    assert np.array_equal(view[page], expected_bytes(toks, i, p.part, layer, p.page_bytes))
        r.release()


def test_layer_hooks_reject_all_layer_backups(make_cache) -> None:
    cache = make_cache(l1_pages=32, host_pages=32, write_policy="write_back")
    r = run_request(cache, tokens_of(5, 6))
    assert r.node is not None
    bk = cache.start_backup(r.node)
    assert bk is not None and not bk.layerwise
    with pytest.raises(ValueError, match="all-layer backup"):
        cache.on_layer_end(Model.TARGET, 0, [bk])
    land(cache)


def test_copy_failure_aborts_and_releases(make_cache) -> None:
    gate = threading.Event()

    def fault(direction: Direction, part: Part, layer: int) -> None:
        if part is Part.TARGET_KV and layer == 0:
            raise RuntimeError("injected D2H failure")
        if part is Part.TARGET_KV and layer == 3:
            gate.wait(30)  # a slow copy keeps the op in flight

    cache = make_cache(l1_pages=32, host_pages=32, fault=fault)
    l2 = cache.host_pool.allocator
    free0 = l2.free_pages
    r = run_request(cache, tokens_of(5, 6), stop_after="insert")
    bk, node = r.bk, r.node
    assert bk is not None and node is not None
    bk.inflight[0]._future.exception(timeout=30)  # the failing layer-0 copy finished
    cache.poll()
    # FAILING: a copy failed, layer 3 is still in flight: pages stay reserved, invisible.
    assert bk.state is BackupState.FAILING
    assert l2.free_pages == free0 - 2 and node.host_state is HostState.PENDING
    assert cache.match_prefix(tokens_of(5, 6)).host_len == 0
    cache.release(node)  # the probe's lock
    gate.set()
    land(cache)
    # ABORTED: drained; the reservation is released and the node never became visible.
    assert bk.state is BackupState.ABORTED
    assert l2.free_pages == free0
    assert node.host_state is HostState.NONE and node.host_pages is None and not node.host_parts
    assert cache.metrics.backups_aborted == 1 and cache.metrics.backups_committed == 0
    r.release()
    evict_all_l1(cache)
    # Nothing cached anywhere: a miss.
    m = cache.match_prefix(tokens_of(5, 6))
    assert m.matched_pages == 0
    cache.release(m.last_node)


def test_abort_waits_for_in_flight_copies(make_cache) -> None:
    faults = Faults()
    cache = make_cache(l1_pages=32, host_pages=32, fault=faults)
    l2 = cache.host_pool.allocator
    free0 = l2.free_pages
    faults.hold()  # every copy blocks at the gate
    r = run_request(cache, tokens_of(7, 8, 9), stop_after="insert")
    bk = r.bk
    assert bk is not None and bk.state is BackupState.WRITING
    cache.abort_backup(bk)
    # FAILING: abort requested, copies still running: the pages must not be reused yet.
    assert bk.state is BackupState.FAILING
    for _ in range(3):
        cache.poll()
        assert bk.state is BackupState.FAILING and l2.free_pages == free0 - 3
    cache.abort_backup(bk)  # a second request is a no-op
    faults.open()
    land(cache)
    # ABORTED once drained: reservation released.
    assert bk.state is BackupState.ABORTED and l2.free_pages == free0
    assert r.node is not None and r.node.host_state is HostState.NONE
    r.release()


def test_backup_of_unattached_reservation_waits_for_insert(make_cache) -> None:
    cache = make_cache(l1_pages=32, host_pages=32)
    r = run_request(cache, tokens_of(1, 2), stop_after="draft")
    land(cache)
    # Every layer landed but no node yet: the op waits (no commit without a node).
    assert r.bk is not None and r.bk.state is BackupState.WRITING
    node = r.insert()
    cache.poll()
    assert r.bk.state is BackupState.COMMITTED and node.host_visible
    r.release()


def _l1_bytes(cache, pages: np.ndarray) -> dict[tuple[Part, int], np.ndarray]:  # type: ignore[no-untyped-def]
    """Every part's and layer's bytes of these L1 pages (a copy)."""
    return {
        (p.part, layer): cache.device_pool.layer_view(p.part, p.slot(layer))[pages].copy()
        for p in cache.layout.parts
        for layer in p.layer_ids
    }


def _wipe_l1(cache) -> None:  # type: ignore[no-untyped-def]
    for p in cache.layout.parts:
        for s in range(p.num_slots):
            cache.device_pool.layer_view(p.part, s)[:] = 0


def _load_and_check_bytes(cache, toks: np.ndarray) -> None:  # type: ignore[no-untyped-def]
    """With L1 evicted and wiped: `toks` is a whole L2 hit whose load brings back
    exactly what the forwards wrote, every part, every layer, every page."""
    evict_all_l1(cache)
    _wipe_l1(cache)
    n = len(toks) // cache.layout.page_size
    c = run_request(cache, toks, stop_after="load")
    assert c.m is not None and c.m.device_len == 0 and c.m.host_len == n, (c.m.device_len, c.m.host_len)
    assert c.load is not None
    land(cache)
    assert c.load.state is LoadState.DONE
    for p in cache.layout.parts:
        for layer in p.layer_ids:
            view = cache.device_pool.layer_view(p.part, p.slot(layer))
            for pos, page in enumerate(c.load.device_pages):
                assert np.array_equal(view[page], expected_bytes(toks, pos, p.part, layer, p.page_bytes)), (
                    f"page {pos}, part {p.part.value}, layer {layer}"
                )
    c.release()


def test_backup_trimmed_to_the_pages_new_to_the_tree(make_cache) -> None:
    """Two requests compute overlapping prefixes; the second's insert finds the
    first pages present. Its backup keeps the new suffix and releases the rest."""
    cache = make_cache(l1_pages=32, host_pages=32)
    l2 = cache.host_pool.allocator
    free0 = l2.free_pages
    short, long = tokens_of(1, 2), tokens_of(1, 2, 3, 4)
    a = run_request(cache, short, stop_after="draft", write=fill_pattern)
    b = run_request(cache, long, stop_after="draft", write=fill_pattern)
    # Both missed and computed everything: A reserved 2 host pages, B 4.
    assert a.m.matched_pages == 0 and b.m.matched_pages == 0  # type: ignore[union-attr]
    assert a.bk is not None and b.bk is not None and l2.free_pages == free0 - 6
    a_node = a.insert()
    # A's node (positions 0..2) is PENDING on A's backup.
    assert a_node.host_state is HostState.PENDING and a_node.backup is a.bk
    b_node = b.insert()
    # B's insert found positions 0..2 in the tree (PENDING on A): B's duplicates were
    # freed, its new node (2..4) is PENDING on B's backup with B's host pages 2..4;
    # B's host pages 0..2 are spare, still held (B's copies may be writing them).
    assert b_node.parent is a_node and b_node.first_position == 2 and b_node.num_pages == 2
    assert b.bk.state is BackupState.WRITING and b.bk.nodes == [b_node]
    assert np.array_equal(b_node.host_pages, b.bk.host_pages[2:])
    assert np.array_equal(b.bk.spare_host_pages, b.bk.host_pages[:2])
    assert l2.free_pages == free0 - 6 and cache.metrics.backup_pages_trimmed == 2
    probe = cache.match_prefix(long)
    assert probe.host_len == 0 and probe.device_len == 4  # pending copies are invisible
    cache.release(probe.last_node)
    land(cache)
    # COMMITTED: both nodes' copies are visible, B's spare pages went back to L2.
    assert a.bk.state is BackupState.COMMITTED and b.bk.state is BackupState.COMMITTED
    assert a_node.host_visible and b_node.host_visible and b_node.backup is None
    assert l2.free_pages == free0 - 4 and not len(b.bk.spare_host_pages)
    assert cache.metrics.backups_aborted == 0 and cache.metrics.backup_pages_dropped == 0
    a.release()
    b.release()
    # A later request for the whole prefix is an L2 hit of all 4 pages, byte-exact.
    _load_and_check_bytes(cache, long)
    cache.check_invariants()


def _first_inserted_without_host_copy(cache, short: np.ndarray, long: np.ndarray):  # type: ignore[no-untyped-def]
    """Requests A (`short`) and B (`long`, extending it) both computed, A's backup
    aborted and A inserted (still holding its node): A's node is in L1 with no
    host copy when B inserts. Returns (A, B, A's node)."""
    a = run_request(cache, short, stop_after="draft", write=fill_pattern)
    b = run_request(cache, long, stop_after="draft", write=fill_pattern)
    assert a.bk is not None and b.bk is not None
    cache.abort_backup(a.bk)
    a_node = a.insert()
    land(cache)
    return a, b, a_node


def test_l1_node_without_host_copy_takes_the_inserting_request_pages(make_cache) -> None:
    """The tree's copy of the first pages has no host copy and nobody holds it: the
    second request's pages, already being copied, replace it (no second copy)."""
    cache = make_cache(l1_pages=32, host_pages=32)
    l1, l2 = cache.device_pool.allocator, cache.host_pool.allocator
    long = tokens_of(5, 6, 7)
    a, b, a_node = _first_inserted_without_host_copy(cache, tokens_of(5, 6), long)
    a.release()
    a_pages = a_node.device_pages.copy()  # type: ignore[union-attr]
    # A's node is in L1 only (its backup aborted) and unlocked.
    assert a.bk.state is BackupState.ABORTED and a_node.host_state is HostState.NONE and a_node.lock_ref == 0
    b_node = b.insert()
    # B's pages 0..2 replaced A's (freed), and B's backup covers both nodes: nothing spare.
    assert np.array_equal(a_node.device_pages, b.new[:2])  # type: ignore[index]
    assert not np.isin(a_pages, np.concatenate([n.device_pages for n in cache.tree.nodes()])).any()
    assert l1.used_pages == 3
    assert sorted(n.id for n in b.bk.nodes) == sorted([a_node.id, b_node.id]) and not len(b.bk.spare_host_pages)
    assert a_node.host_state is HostState.PENDING and np.array_equal(a_node.host_pages, b.bk.host_pages[:2])
    land(cache)
    assert b.bk.state is BackupState.COMMITTED and a_node.host_visible and b_node.host_visible
    # A's own 2 pages counted as dropped at A's insert (its backup had aborted); B's none.
    assert l2.used_pages == 3 and cache.metrics.backup_pages_dropped == 2
    b.release()
    _load_and_check_bytes(cache, long)
    cache.check_invariants()


def test_held_l1_node_without_host_copy_keeps_its_pages(make_cache) -> None:
    """The same, but a request still holds the tree's copy: its L1 pages stay (freeing
    them would be a use-after-free), and the second request's backup is trimmed."""
    cache = make_cache(l1_pages=32, host_pages=32)
    l2 = cache.host_pool.allocator
    a, b, a_node = _first_inserted_without_host_copy(cache, tokens_of(8, 9), tokens_of(8, 9, 10))
    a_pages = a_node.device_pages.copy()  # type: ignore[union-attr]
    before = _l1_bytes(cache, a_pages)
    # A still holds its node (lock 1): in L1 only, no host copy.
    assert a_node.host_state is HostState.NONE and a_node.lock_ref == 1
    b_node = b.insert()
    # A's pages are untouched; B's duplicates went back; B's backup keeps 2..3 only.
    assert np.array_equal(a_node.device_pages, a_pages)
    assert all(np.array_equal(v, _l1_bytes(cache, a_pages)[k]) for k, v in before.items())
    assert b.bk.nodes == [b_node] and np.array_equal(b.bk.spare_host_pages, b.bk.host_pages[:2])
    land(cache)
    assert b.bk.state is BackupState.COMMITTED and b_node.host_visible and a_node.host_state is HostState.NONE
    assert l2.used_pages == 1
    a.release()
    b.release()
    cache.check_invariants()


def test_backup_of_pages_all_present_is_aborted_with_the_reason(make_cache) -> None:
    cache = make_cache(l1_pages=32, host_pages=32)
    l2 = cache.host_pool.allocator
    a = run_request(cache, tokens_of(11, 12), stop_after="draft")
    b = run_request(cache, tokens_of(11, 12), stop_after="draft")
    a.insert()
    b.insert()
    # Every page of B's was in the tree with a (pending) host copy: nothing to keep.
    assert b.bk is not None and b.bk.state is BackupState.FAILING and not b.bk.nodes
    assert "all in the tree already" in str(b.bk.error)
    land(cache)
    assert b.bk.state is BackupState.ABORTED and l2.used_pages == 2
    assert cache.metrics.backup_pages_dropped == 0
    a.release()
    b.release()


def test_insert_refuses_a_backup_reserved_for_other_pages(make_cache) -> None:
    cache = make_cache(l1_pages=32, host_pages=32)
    a = run_request(cache, tokens_of(13, 14), stop_after="draft")
    b = run_request(cache, tokens_of(15), stop_after="draft")
    with pytest.raises(ValueError, match="not the 2 pages inserted at position 0"):
        cache.insert(a.m, a.new, backup=b.bk)
    a.insert()
    b.insert()
    land(cache)
    a.release()
    b.release()


def test_illegal_transitions_raise(make_cache) -> None:
    cache = make_cache()
    layout = cache.layout
    bk = BackupOp(layout, np.array([1]), np.array([1]), 0)
    with pytest.raises(IllegalTransition):
        bk.transition(BackupState.COMMITTED)  # RESERVED -> COMMITTED skips WRITING
    bk.transition(BackupState.WRITING)
    bk.transition(BackupState.COMMITTED)
    with pytest.raises(IllegalTransition):
        bk.transition(BackupState.ABORTED)  # terminal
    bk2 = BackupOp(layout, np.array([1]), np.array([1]), 0)
    bk2.transition(BackupState.FAILING)
    with pytest.raises(IllegalTransition):
        bk2.transition(BackupState.COMMITTED)  # a failing op never commits
    with pytest.raises(IllegalTransition):
        bk2.transition(BackupState.WRITING)
    ld = LoadOp(layout, np.array([1]), np.array([1]), 0)
    with pytest.raises(IllegalTransition):
        ld.transition(LoadState.DONE)  # RESERVED -> DONE skips LOADING
    ld.transition(LoadState.LOADING)
    ld.transition(LoadState.FAILING)
    with pytest.raises(IllegalTransition):
        ld.transition(LoadState.DONE)
    ld.transition(LoadState.ABORTED)
    with pytest.raises(IllegalTransition):
        ld.transition(LoadState.LOADING)


# ---- load back -----------------------------------------------------------------------------


def test_load_back_per_layer_with_correct_bytes(make_cache) -> None:
    faults = Faults()
    cache = make_cache(l1_pages=32, host_pages=32, fault=faults)
    toks = tokens_of(11, 12, 13)
    a = run_request(cache, toks, write=fill_pattern)
    node = a.node
    assert node is not None and node.host_visible
    evict_all_l1(cache)
    # The node lives in L2 only; wipe L1 so stale bytes cannot pass the check.
    assert node.device_pages is None
    for p in cache.layout.parts:
        for s in range(p.num_slots):
            cache.device_pool.layer_view(p.part, s)[:] = 0
    l1 = cache.device_pool.allocator
    l1_free0 = l1.free_pages

    faults.hold()
    b = run_request(cache, np.concatenate([toks, tokens_of(14)]), stop_after="load")
    load = b.load
    assert load is not None and b.m is not None
    # LOADING (RESERVED is internal to load_back: pages assigned, every layer submitted).
    assert load.state is LoadState.LOADING and b.m.host_nodes == [node]
    assert node.load is load and node.on_device and l1.free_pages == l1_free0 - 3
    # Source host pages are pinned: not an L2 eviction candidate, even under pressure.
    assert node not in cache.tree.host_leaves
    evict_all_l2(cache)
    assert node.host_visible and node.host_pages is not None
    cache.poll()
    assert load.state is LoadState.LOADING  # nothing landed yet
    faults.open()
    # The forward waits per layer; after wait_layer(l) layer l is on the device.
    for layer in range(cache.layout.num_layers(Model.TARGET)):
        load.wait_layer(layer, Model.TARGET)
        for p in cache.layout.parts_of(Model.TARGET):
            if p.has_layer(layer):
                view = cache.device_pool.layer_view(p.part, p.slot(layer))
                for i, page in enumerate(node.device_pages):
                    assert np.array_equal(view[page], expected_bytes(toks, i, p.part, layer, p.page_bytes))
    load.wait_layer(0, Model.DRAFT)
    for p in cache.layout.parts_of(Model.DRAFT):
        view = cache.device_pool.layer_view(p.part, p.slot(0))
        for i, page in enumerate(node.device_pages):
            assert np.array_equal(view[page], expected_bytes(toks, i, p.part, 0, p.page_bytes))
    land(cache)
    # DONE: the node is on both tiers again, no op attached.
    assert load.state is LoadState.DONE and node.load is None and node.on_device and node.host_visible
    b.alloc()
    b.reserve()
    b.forward()
    b.insert()
    land(cache)
    b.release()
    assert cache.metrics.loads_done == 1


def _l2_only_then_fail_next_load(cache, faults: Faults, toks: np.ndarray) -> None:  # type: ignore[no-untyped-def]
    """Cache `toks` in L2 only (backed up, evicted from L1); the next load copy fails."""
    a = run_request(cache, toks, write=fill_pattern)
    assert a.node is not None
    if not a.node.host_visible:  # write_back: back it up by hand so it can be loaded
        cache.start_backup(a.node)
        land(cache)
    evict_all_l1(cache)
    faults.fail_direction, faults.fail_next = Direction.H2D, 1


def test_load_failure_aborts(make_cache) -> None:
    """A failed load aborts on poll. Current contract (cache._decide_load): the L1
    pages stay with the nodes, which the request still holds locked, and the
    request must recompute them; the L2 copy stays committed."""
    faults = Faults()
    cache = make_cache(l1_pages=32, host_pages=32, fault=faults)
    toks = tokens_of(21, 22)
    _l2_only_then_fail_next_load(cache, faults, toks)
    l1 = cache.device_pool.allocator
    l2 = cache.host_pool.allocator
    l1_free0, l2_free0 = l1.free_pages, l2.free_pages
    b = run_request(cache, toks, stop_after="load")
    load = b.load
    assert load is not None and load.state is LoadState.LOADING and l1.free_pages == l1_free0 - 2
    node = b.m.host_nodes[0]  # type: ignore[union-attr]
    load.wait_layer(0)  # a failed copy is recorded, not raised
    assert load.error is not None
    land(cache)
    # ABORTED: nothing in flight any more; the node's L1 pages belong to the locked
    # request (to recompute), the L2 copy is untouched and still visible.
    assert load.state is LoadState.ABORTED and node.load is None
    assert cache.in_flight() == ([], [])
    assert node.host_visible and l2.free_pages == l2_free0
    assert cache.metrics.loads_aborted == 1 and cache.metrics.loads_done == 0
    assert node.lock_ref == 1 and node not in cache.tree.device_leaves  # the request holds it
    b.release()
    evict_all_l1(cache)
    # Once released the recomputed pages are ordinary L1 pages: evictable, all returned.
    assert l1.free_pages == l1_free0 and not node.on_device
    # A later request loads it fine.
    c = run_request(cache, toks)
    assert c.load is not None and c.load.state is LoadState.DONE


def _abort_a_load(cache, faults: Faults, toks: np.ndarray):  # type: ignore[no-untyped-def]
    """Cache `toks` in L2 only, then start a request whose load of them fails."""
    _l2_only_then_fail_next_load(cache, faults, toks)
    b = run_request(cache, toks, stop_after="poll")
    assert b.load is not None and b.load.state is LoadState.ABORTED
    node = b.m.host_nodes[0]  # type: ignore[union-attr]
    assert node.stale_load is b.load and node.on_device
    return b, node


def test_aborted_load_pages_are_no_hit_until_recomputed(make_cache) -> None:
    """Between a load's abort and its request's recompute the node's L1 pages
    hold garbage: another request must miss them, not read them; `recomputed`
    makes them a device hit again."""
    faults = Faults()
    cache = make_cache(l1_pages=32, host_pages=32, fault=faults)
    toks = tokens_of(41, 42)
    b, node = _abort_a_load(cache, faults, toks)
    probe = cache.match_prefix(toks)
    assert probe.device_len == 0 and probe.host_len == 0  # a miss (the L2 copy is shadowed by L1)
    cache.release(probe.last_node)
    for p in cache.layout.parts:  # the owner recomputes in place, then says so
        for layer in p.layer_ids:
            view = cache.device_pool.layer_view(p.part, p.slot(layer))
            for i, page in enumerate(b.load.device_pages):
                view[page] = expected_bytes(toks, i, p.part, layer, p.page_bytes)
    with pytest.raises(ValueError, match="not aborted"):
        cache.recomputed(LoadOp(cache.layout, np.array([1]), np.array([1]), 0))
    cache.recomputed(b.load)
    assert node.stale_load is None
    hit = cache.match_prefix(toks)
    assert hit.device_len == 2
    cache.release(hit.last_node)
    b.release()


def test_stale_pages_of_an_abandoned_request_are_never_backed_up(make_cache) -> None:
    """The owner went away without recomputing: once the L2 copy is evicted the
    stale L1 pages are the only copy, and they must be dropped, not backed up."""
    faults = Faults()
    cache = make_cache(l1_pages=32, host_pages=32, fault=faults, write_policy="write_back")
    b, node = _abort_a_load(cache, faults, tokens_of(43, 44))
    b.release()
    with pytest.raises(ValueError, match="after the request released it"):  # too late: nobody rewrote them
        cache.recomputed(b.load)
    assert node.stale_load is not None
    evict_all_l2(cache)
    assert node.host_state is HostState.NONE and node.stale_load is not None
    with pytest.raises(ValueError, match="awaiting recompute"):
        cache.start_backup(node)
    started = cache.metrics.backups_started
    evict_all_l1(cache)  # write_back would back up an unbacked node first: not this one
    assert cache.metrics.backups_started == started
    assert cache.device_pool.allocator.free_pages == cache.device_pool.allocator.capacity
    assert list(cache.tree.nodes()) == []


def test_backup_computed_on_an_aborted_load_aborts_and_its_pages_are_stale(make_cache) -> None:
    """Pages computed on a prefix whose load then aborts: their backup depends
    on the load (`after`), so it aborts in the same poll even though all its own
    copies landed, and the pages are stale (no hit, never backed up)."""
    faults = Faults()
    cache = make_cache(l1_pages=32, host_pages=32, fault=faults)
    prefix = tokens_of(51, 52)
    _l2_only_then_fail_next_load(cache, faults, prefix)
    b = run_request(cache, np.concatenate([prefix, tokens_of(53)]), stop_after="insert")
    assert b.load is not None and b.bk is not None and b.bk.after == [b.load]
    land(cache)
    assert b.bk.all_landed(), "the backup's own copies all landed"
    assert b.load.state is LoadState.ABORTED and b.bk.state is BackupState.ABORTED
    assert b.node is not None and b.node.host_state is HostState.NONE
    assert b.node.stale_load is b.load  # computed on invalid KV
    probe = cache.match_prefix(np.concatenate([prefix, tokens_of(53)]))
    assert probe.matched_pages == 0  # neither the loaded prefix nor what was computed on it
    cache.release(probe.last_node)
    b.release()


def test_a_request_that_waited_on_an_aborted_load_learns_it(make_cache) -> None:
    """B matches A's nodes while A's load is in flight (a device hit that waits);
    the load aborts: B's match says its prefix failed."""
    faults = Faults()
    cache = make_cache(l1_pages=32, host_pages=32, fault=faults)
    toks = tokens_of(61, 62)
    _l2_only_then_fail_next_load(cache, faults, toks)
    faults.hold()
    a = run_request(cache, toks, stop_after="load")
    b = run_request(cache, np.concatenate([toks, tokens_of(63)]), stop_after="match")
    assert b.m is not None and b.m.device_len == 2 and b.m.waits == [a.load]
    assert not b.m.prefix_failed
    faults.open()
    land(cache)
    assert a.load is not None and a.load.state is LoadState.ABORTED
    assert b.m.prefix_failed
    b.release()
    a.release()


def test_load_failure_with_insert_before_poll_keeps_tree_consistent(make_cache) -> None:
    """The protocol inserts before it polls: the pages inserted below a load that
    then fails must leave every tree and allocator invariant intact."""
    faults = Faults()
    cache = make_cache(l1_pages=32, host_pages=32, fault=faults)
    toks = tokens_of(31, 32)
    _l2_only_then_fail_next_load(cache, faults, toks)
    l1 = cache.device_pool.allocator
    l2 = cache.host_pool.allocator
    l1_free0, l2_free0 = l1.free_pages, l2.free_pages
    b = run_request(cache, np.concatenate([toks, tokens_of(33, 34)]), stop_after="insert")
    # The load failed but is not polled yet; the request inserted 2 pages below it.
    assert b.load is not None and b.node is not None and b.node.on_device
    land(cache)
    land(cache)
    # The load aborted; the device prefix and the node below it stay consistent.
    assert b.load.state is LoadState.ABORTED
    cache.check_invariants()
    # The 2 pages computed on the invalid prefix are stale, their backup aborted
    # and its reservation returned; the host copy of the prefix itself stays.
    assert b.node.stale_load is b.load
    assert b.bk is not None and b.bk.state is BackupState.ABORTED
    assert l2.free_pages == l2_free0
    assert l1.free_pages == l1_free0 - 4  # 2 loaded + 2 computed, still held by the request
    b.release()
    evict_all_l1(cache)
    evict_all_l2(cache)
    assert l1.free_pages == l1.capacity and l2.free_pages == l2.capacity


# ---- eviction --------------------------------------------------------------------------------


def test_l2_eviction_frees_all_parts_together(make_cache) -> None:
    cache = make_cache(l1_pages=32, host_pages=16)
    l2 = cache.host_pool.allocator
    free0 = l2.free_pages
    a = run_request(cache, tokens_of(1, 2, 3, 4))
    node = a.node
    assert node is not None and node.host_visible
    assert l2.free_pages == free0 - 4
    evict_all_l2(cache)
    # One page id serves every part: freeing it frees all parts; nothing partial remains.
    assert l2.free_pages == free0
    assert node.host_state is HostState.NONE and node.host_pages is None and node.host_parts == frozenset()
    assert node.on_device  # the L1 copy is untouched
    evict_all_l1(cache)
    assert len(list(cache.tree.nodes())) == 0  # fully evicted nodes are pruned


def test_ensure_free_evicts_to_target_not_deficit(make_cache) -> None:
    cache = make_cache(l1_pages=41, host_pages=64)  # 40 allocatable L1 pages
    l1 = cache.device_pool.allocator
    for i in range(10):  # ten unrelated 4-page prefixes fill L1
        run_request(cache, tokens_of(100 + i, 1, 2, 3))
    assert l1.free_pages == 0
    cache.config.l1_free_room = 12  # target: 12 free pages
    cache.ensure_free()
    assert l1.free_pages >= 12
    assert l1.free_pages < 12 + 4  # whole nodes, oldest first, no more than needed
    # An allocation under pressure also evicts to target + need, not only the need.
    cache.config.l1_free_room = 8
    r = run_request(cache, tokens_of(200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14), stop_after="alloc")
    assert l1.free_pages >= 8
    r.abandon()


def test_locked_nodes_are_never_evicted(make_cache) -> None:
    cache = make_cache(l1_pages=17, host_pages=16)  # 16 L1 pages, 16 L2 pages
    a = run_request(cache, tokens_of(1, 2, 3, 4), stop_after="poll")  # holds its lock
    held = a.node
    assert held is not None and held.lock_ref == 1
    evict_all_l1(cache)
    evict_all_l2(cache)
    # Locked: keeps both its L1 and L2 copies whatever the pressure.
    assert held.on_device and held.host_visible
    # Another request cannot take its pages either.
    r = run_request(cache, tokens_of(9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9), stop_after="match")
    assert cache.alloc_device(13, 0) is None  # only 12 free; the locked 4 stay
    r.release()
    assert held.on_device
    a.release()
    evict_all_l1(cache)
    assert not held.on_device


def test_write_through_selective_after_threshold(make_cache, caplog) -> None:
    cache = make_cache(write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE, write_threshold=2)
    toks = tokens_of(1, 2, 3)
    a = run_request(cache, toks)
    # No backup during the forward under this policy.
    assert a.bk is None and a.node is not None and a.node.host_state is HostState.NONE
    with caplog.at_level(logging.WARNING, logger="hicache_cp.cache"):
        b = run_request(cache, toks, stop_after="match")  # hit 1
        assert b.m is not None and b.m.device_len == 3
        assert a.node.host_state is HostState.NONE and not caplog.records
        b.release()
        c = run_request(cache, toks, stop_after="match")  # hit 2: threshold reached
        # The all-layer fallback started a backup (PENDING), with a warning.
        assert a.node.host_state is HostState.PENDING
        assert any("all-layer" in rec.getMessage() for rec in caplog.records)
        assert all(rec.levelno == logging.WARNING for rec in caplog.records)
    c.release()
    land(cache)
    assert a.node.host_visible and cache.metrics.backups_all_layer == 1


def test_write_back_backs_up_on_eviction_and_evicts_after_commit(make_cache) -> None:
    faults = Faults()
    cache = make_cache(write_policy=WritePolicy.WRITE_BACK, fault=faults)
    l1 = cache.device_pool.allocator
    a = run_request(cache, tokens_of(1, 2, 3), write=fill_pattern)
    node = a.node
    assert node is not None and a.bk is None and node.host_state is HostState.NONE
    faults.hold()
    evict_all_l1(cache)
    # Eviction started a backup instead of dropping the only copy: still on device.
    assert node.host_state is HostState.PENDING and node.on_device
    used = l1.used_pages
    evict_all_l1(cache)
    assert node.on_device and l1.used_pages == used  # pending: not evictable
    faults.open()
    land(cache)
    assert node.host_visible and node.on_device
    evict_all_l1(cache)
    # Committed: now the L1 copy goes, the L2 copy stays and loads back intact.
    assert not node.on_device and node.host_visible
    b = run_request(cache, tokens_of(1, 2, 3))
    assert b.load is not None and b.load.state is LoadState.DONE
    for p in cache.layout.parts:
        for layer in p.layer_ids:
            view = cache.device_pool.layer_view(p.part, p.slot(layer))
            for i, page in enumerate(node.device_pages):
                assert np.array_equal(view[page], expected_bytes(tokens_of(1, 2, 3), i, p.part, layer, p.page_bytes))


# ---- consistency -----------------------------------------------------------------------------


def test_committed_node_missing_a_part_raises(make_cache) -> None:
    cache = make_cache()
    a = run_request(cache, tokens_of(1, 2))
    node = a.node
    assert node is not None
    evict_all_l1(cache)
    cache.config.debug_checks = False  # the corruption would trip the invariant check first
    node.host_parts = node.host_parts - {Part.DRAFT_STATE}
    with pytest.raises(ConsistencyError) as info:
        cache.match_prefix(tokens_of(1, 2))
    err = info.value
    assert err.node == node.id and err.part == "draft_state" and err.rank == 0
    assert f"node={node.id}" in str(err) and "draft_state" in str(err)
    cache.config.debug_checks = True
    with pytest.raises(AssertionError, match="committed without every part"):
        cache.check_invariants()


def test_evict_device_empties_l1_and_keeps_every_committed_host_copy(make_cache) -> None:
    """`HiCache.evict_device` (the TTFT probe's way to make a prefix L2-only): unlocked L1
    pages go, committed host copies stay, a locked path stays in L1, nothing leaks."""
    cache = make_cache(l1_pages=32, host_pages=32)
    run_request(cache, tokens_of(1, 2, 3), write=fill_pattern)
    land(cache)
    held = run_request(cache, tokens_of(7, 8), write=fill_pattern, stop_after="poll")
    land(cache)  # committed, still locked by its request
    cache.evict_device()
    m = cache.match_prefix(tokens_of(1, 2, 3))
    assert (m.device_len, m.host_len) == (0, 3), "the released prefix is L2-only now"
    cache.release(m.last_node)
    m = cache.match_prefix(tokens_of(7, 8))
    assert m.device_len == 2, "a path a request holds is not evicted"
    cache.release(m.last_node)
    held.release()
    cache.check_invariants()


def test_freed_pages_are_poisoned_under_debug_checks(make_cache) -> None:
    """With debug checks (every test cache) an L1 or L2 page freed by eviction holds
    POISON_BYTE in every part and layer: a read after the free fails the byte
    checks instead of passing on the KV the page used to hold."""
    from hicache_cp.pools import POISON_BYTE

    cache = make_cache()
    r = run_request(cache, tokens_of(61, 62, 63), write=fill_pattern)
    device, host = r.node.device_pages.copy(), r.node.host_pages.copy()
    evict_all_l1(cache)
    evict_all_l2(cache)
    for p in cache.layout.parts:
        for slot in range(p.num_slots):
            assert (cache.device_pool.layer_view(p.part, slot)[device] == POISON_BYTE).all(), (p.part, slot)
            assert (cache.host_pool.layer_view(p.part, slot)[host] == POISON_BYTE).all(), (p.part, slot)
    quiet = make_cache(debug_checks=False)  # a server does not pay for it
    r = run_request(quiet, tokens_of(61, 62, 63), write=fill_pattern)
    pages = r.node.device_pages.copy()
    evict_all_l1(quiet)
    view = quiet.device_pool.layer_view(Part.TARGET_KV, 0)
    assert (view[pages[0]] == expected_bytes(r.tokens, 0, Part.TARGET_KV, 0, view.shape[1])).all()


def test_poison_touches_only_the_pages_this_rank_owns() -> None:
    from hicache_cp.config import Config
    from hicache_cp.pools import POISON_BYTE, DevicePool, HostPool

    layout = Config(model="tiny").layout()
    device = DevicePool(layout, 9, cp_size=2, rank=1)  # logical pages 2, 4, 6, ... live here
    with HostPool(layout, 9 * layout.bytes_per_page, cp_size=2, rank=1, pin=False) as host:
        for pool in (device, host):
            pool.poison(np.array([1, 2, 3, 4]))  # rank 1 owns 2 and 4: physical 1 and 2
            view = pool.layer_view(Part.TARGET_KV, 0)
            assert (view[[1, 2]] == POISON_BYTE).all() and not view[[0, 3, 4]].any()
