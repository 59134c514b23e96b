"""Faults that once passed every test (issue 29, class 7), each held here by a
test that fails on the fault: a race in the prefix-hash cache, a stale node
replaced under the request that holds it, and a host budget not agreed by MIN
across CP ranks."""

from __future__ import annotations

import sys
import threading

import numpy as np

from hicache_cp import keys


def _reference_prefix_hashes(tokens: np.ndarray, page_size: int) -> np.ndarray:
    """The chain x_i = x_{i-1} * P + g_i, one page at a time (no cache)."""
    g = keys.page_hashes(tokens, page_size)
    out = np.empty_like(g)
    x = np.uint64(0)
    with np.errstate(over="ignore"):
        for i, gi in enumerate(g):
            x = x * keys._P + gi
            out[i] = x
    return out


class _PausingNumpy:
    """numpy, except that building the inverse powers pauses the thread doing it
    until the other thread has hashed (or a second passed): the moment between
    the two halves of a cache update, held open."""

    def __init__(self, reader_done: threading.Event, writer_paused: threading.Event) -> None:
        self.reader_done = reader_done
        self.writer_paused = writer_paused

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(np, name)

    def full(self, size, value, dtype=None):  # type: ignore[no-untyped-def]
        if value == keys._P_INV and threading.current_thread().name == "grower":
            self.writer_paused.set()
            self.reader_done.wait(timeout=1.0)  # the fixed cache holds the reader on its lock: time out
        return np.full(size, value, dtype=dtype)


def test_power_cache_never_pairs_new_powers_with_old_inverses(monkeypatch) -> None:
    """A thread hashing while another grows the cache gets P**i and P**-i of one
    build: the cache grew in two steps without a lock, and a reader between
    them got the new powers with the old, shorter inverses."""
    small = (np.cumprod(np.full(1024, keys._P, dtype=np.uint64), dtype=np.uint64),
             np.cumprod(np.full(1024, keys._P_INV, dtype=np.uint64), dtype=np.uint64))  # fmt: skip
    monkeypatch.setattr(keys, "_POWERS", type(keys._POWERS)(keys._build_powers, small))
    reader_done, writer_paused = threading.Event(), threading.Event()
    monkeypatch.setattr(keys, "np", _PausingNumpy(reader_done, writer_paused))
    toks = np.random.default_rng(0).integers(0, 50_000, size=1500 * 4)  # 1500 pages: more than the cache holds
    grower = threading.Thread(target=keys._powers, args=(1 << 14,), name="grower")
    grower.start()
    assert writer_paused.wait(timeout=10)
    try:
        got = keys.prefix_hashes(toks, 4)
    finally:
        reader_done.set()
        grower.join(timeout=10)
    monkeypatch.setattr(keys, "np", np)
    assert np.array_equal(got, _reference_prefix_hashes(toks, 4))
    fwd, inv = keys._powers(1 << 14)
    with np.errstate(over="ignore"):
        assert np.all(fwd * inv == 1)


# ---- insert over a stale node -------------------------------------------------------------------


def test_insert_never_replaces_a_stale_node_that_a_request_still_holds(make_cache) -> None:
    """Request B's load aborted: the node's L1 pages are B's to recompute and B
    holds the node. Request C computes the same prefix meanwhile (a miss: the
    node is stale) and inserts it. C's pages are the surplus; the node keeps
    B's, which stay allocated. Replacing them freed B's pages under B (a
    use-after-free: the next allocation hands them to someone else)."""
    from conftest import Faults, run_request, tokens_of
    from test_cache_scenarios import _abort_a_load

    faults = Faults()
    cache = make_cache(l1_pages=32, host_pages=32, fault=faults)
    l1 = cache.device_pool.allocator
    toks = tokens_of(51, 52)
    b, node = _abort_a_load(cache, faults, toks)
    b_pages = np.array(b.load.device_pages).copy()
    assert node.lock_ref >= 1 and np.array_equal(node.device_pages, b_pages)
    c = run_request(cache, toks)  # computes both pages itself (a miss), inserts, releases
    assert c.m.device_len == 0 and c.m.host_len == 0
    # The node still points at B's pages, still awaiting B's recompute.
    assert np.array_equal(node.device_pages, b_pages) and node.stale_load is b.load
    # B's pages are not free: everything the allocator hands out now is disjoint from them.
    grabbed = l1.alloc(l1.free_pages)
    assert grabbed is not None
    assert not set(grabbed.tolist()) & set(b_pages.tolist()), "B's L1 pages were freed while B held them"
    l1.free(grabbed)
    b.release()
    cache.check_invariants()


# ---- the automatic host budget across CP ranks ----------------------------------------------


class _FakeMemory:
    """What `host_memory` reports, different on each rank."""

    def __init__(self, pool_bytes: int) -> None:
        self.pool_bytes = pool_bytes

    def describe(self) -> str:
        return f"fake: pool {self.pool_bytes} B"


def _auto_budget_rank(ctx, mib_by_rank: list[int]):  # type: ignore[no-untyped-def]
    """Runs in a CP rank: this rank measures its own memory; build the cache."""
    from hicache_cp.cache import HiCache, build
    from hicache_cp.config import Config

    build.host_memory = lambda reserve: _FakeMemory(mib_by_rank[ctx.rank] << 20)  # type: ignore[assignment]
    config = Config(model="tiny", cp_size=ctx.world_size, host_budget_bytes="auto", l1_pages=64)
    with HiCache(config, agreement=ctx.agreement, rank=ctx.rank) as cache:
        return {"budget": build.host_budget(config, ctx.agreement, ctx.rank),
                "l2_capacity_pages": cache.host_pool.allocator.capacity}  # fmt: skip


def test_auto_host_budget_is_the_min_over_cp_ranks(monkeypatch) -> None:
    """Two real ranks that measure 96 and 64 MiB both size L2 from 64 MiB:
    ranks replicate allocator decisions (docs/invariants.md rule 7), so capacities that
    differ per rank diverge the replicated state."""
    from hicache_harness.launch import spawn_ranks

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    out = spawn_ranks(_auto_budget_rank, 2, ([192, 128],), timeout_s=240)
    # 128 MiB shared by the 2 local ranks: 64 MiB each, on both.
    assert [o["budget"] for o in out] == [64 << 20, 64 << 20]
    assert out[0]["l2_capacity_pages"] == out[1]["l2_capacity_pages"] > 0


# ---- L3 counters are final after a drain ----------------------------------------------------


def test_drain_waits_for_l3_write_backs_so_counters_are_final() -> None:
    """The replay reads its L3 counters after `cache.drain()`: the puts queued
    by the last requests must have finished by then (they were counted later,
    after the report was taken)."""
    from conftest import run_request, tokens_of
    from test_l3_support import GatedStore, MemoryStore, l3_cache

    store = GatedStore(MemoryStore())
    store.put_gate.clear()  # puts wait: the drain must wait for them
    cache = l3_cache(store, {"backend": "mooncake", "master": "127.0.0.1:1"}, l1_pages=64, host_budget_bytes=1 << 20)
    try:
        run_request(cache, tokens_of(61, 62, 63))
        assert store.put_waiting.wait(10), "no write-back started"
        threading.Timer(0.3, store.put_gate.set).start()
        cache.drain()
        assert cache.l3 is not None and cache.l3.writes == []
        stats = cache.stats()
        assert stats["l3_put_jobs"] >= 1 and stats["l3_put_bytes"] > 0
    finally:
        store.put_gate.set()
        cache.close()
