"""Property tests of the L3 tier: random request streams, evictions and store
faults over two cache instances that share one store, and CP ranks that
must agree on every L3 decision.

The store here is `MemoryStore`, an in-memory double of the `KVStore`
protocol (thousands of steps in seconds); the same code runs against the
real Mooncake Store in test_l3_cache.py and test_l3_faults.py. After every
step: `check_invariants` on every cache (no L2 page leaks: reservations and
held pages are accounted), and the reference server's byte checks (every
reused page, L3-fetched ones included) found no mismatch and covered
everything reused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from conftest import PAGE, TwoRankAgreement, evict_all_l1, evict_all_l2, tiny_config, tree_snapshot
from test_l3_support import MemoryStore

from hicache_cp.cache import HiCache
from hicache_harness.engines.synthetic import ReferenceServer

# A small universe of prompts that share prefixes: page ids of chat-like turns.
PROMPTS = [
    [1, 2, 3],
    [1, 2, 3, 4, 5],
    [1, 2, 3, 4, 5, 6, 7, 8],
    [1, 2, 9, 10],
    [11, 12, 13, 14, 15, 16],
    [11, 12, 13, 17],
    [20, 21],
    [1, 2, 3, 4, 5, 6, 7, 8, 30, 31, 32],
]


def _tokens(ids: list[int]) -> np.ndarray:
    return np.concatenate([np.full(PAGE, i, dtype=np.int64) for i in ids])


def _l3(**kw: Any) -> dict[str, Any]:
    values: dict[str, Any] = dict(backend="mooncake", prefetch_timeout_s=5.0, lookup_timeout_s=5.0,
                                  retry_interval_s=0.001, close_timeout_s=5.0, pages_per_object=1)  # fmt: skip
    values.update(kw)
    return values


class TwoInstances(RuleBasedStateMachine):
    """Two caches (own L1/L2), one store; faults come and go."""

    @initialize(
        group=st.sampled_from([1, 2]),
        group_parts=st.booleans(),
        wait=st.booleans(),
        queue=st.sampled_from([0, 12]),  # 0: a quarter of L2
    )
    def setup(self, group: int, group_parts: bool, wait: bool, queue: int) -> None:
        self.store = MemoryStore()
        l3 = _l3(pages_per_object=group, group_parts=group_parts, prefetch_wait=wait, write_queue_pages=queue)
        self.caches = [
            HiCache(tiny_config(l1_pages=24, host_pages=12, l3=l3), l3_store=self.store) for _ in range(2)
        ]
        self.servers = [ReferenceServer(c) for c in self.caches]
        self.requests = 0

    @rule(i=st.integers(0, 1), prompt=st.sampled_from(PROMPTS), cold=st.booleans())
    def serve(self, i: int, prompt: list[int], cold: bool) -> None:
        """Serve a prompt on instance i; `cold`: with its L1 and L2 emptied first
        (the prompt can only come from L3, i.e. from the other instance or an
        earlier write of its own)."""
        if cold:
            evict_all_l1(self.caches[i])
            evict_all_l2(self.caches[i])
        self.requests += 1
        self.servers[i].serve(self.requests, _tokens(prompt))

    @rule(i=st.integers(0, 1), l2=st.booleans())
    def evict(self, i: int, l2: bool) -> None:
        evict_all_l1(self.caches[i])
        if l2:
            evict_all_l2(self.caches[i])

    @rule(down=st.booleans())
    def store_down(self, down: bool) -> None:
        self.store.down = down

    @rule(short=st.booleans())
    def short_reads(self, short: bool) -> None:
        self.store.short = short

    @rule(k=st.integers(0, 1000))
    def lose_a_key_at_read(self, k: int) -> None:
        keys = sorted(self.store.objects)  # what is there depends on write-back timing: draw first
        if keys:
            self.store.drop_on_get.add(keys[k % len(keys)])

    @rule(i=st.integers(0, 1))
    def settle(self, i: int) -> None:
        self.caches[i].settle()

    @invariant()
    def consistent(self) -> None:
        for c, srv in zip(getattr(self, "caches", []), getattr(self, "servers", [])):
            c.check_invariants()
            assert srv.integrity.mismatches == 0, srv.integrity.examples
            assert srv.integrity.checked_units == srv.integrity.expected_units
            m = c.metrics
            l3 = c.l3.metrics  # type: ignore[union-attr]
            assert l3.l3_hit_tokens >= 0 and m.l2_hit_tokens >= 0
            assert m.l1_hit_tokens + m.l2_hit_tokens + l3.l3_hit_tokens + m.miss_tokens == m.prompt_tokens

    def teardown(self) -> None:
        for c in getattr(self, "caches", []):
            self.store.down = False
            c.drain()
            c.check_invariants()
            c.close()


TwoInstances.TestCase.settings = settings(
    max_examples=25, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestTwoInstances = TwoInstances.TestCase


def test_l3_hits_happen_in_the_stateful_universe() -> None:
    """The property test above is not vacuous: instance b gets instance a's pages from L3."""
    store = MemoryStore()
    l3 = _l3(write_queue_pages=12)
    a, b = (HiCache(tiny_config(l1_pages=24, host_pages=12, l3=l3), l3_store=store) for _ in range(2))
    try:
        sa, sb = ReferenceServer(a), ReferenceServer(b)
        sa.serve(1, _tokens(PROMPTS[2]))
        a.drain()
        _wait_writes(a)
        sb.serve(2, _tokens(PROMPTS[2]))
        assert b.l3.metrics.l3_hit_pages == 8 and sb.integrity.mismatches == 0  # type: ignore[union-attr]
        assert sb.integrity.checked_units == sb.integrity.expected_units > 0
    finally:
        a.close()
        b.close()


def _wait_writes(cache: HiCache) -> None:
    for _ in range(10_000):
        if not cache.l3.writes:  # type: ignore[union-attr]
            return
        cache.settle()
    raise AssertionError("write-back did not finish")


# ---- CP ranks -----------------------------------------------------------------------------------


def _ranks(store: MemoryStore, **l3: Any) -> list[HiCache]:
    ags = TwoRankAgreement.pair()
    cfg = dict(l1_pages=24, host_pages=12, cp_size=2, l3=_l3(write_queue_pages=12, **l3))
    return [HiCache(tiny_config(**cfg), agreement=ags[r], rank=r, l3_store=store) for r in range(2)]


def _both(caches: list[HiCache], fn: Callable[[int, HiCache], Any]) -> list[Any]:
    """Run `fn(rank, cache)` on both ranks at once (their collectives meet)."""
    out: list[Any] = [None, None]
    err: list[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = fn(r, caches[r])
        except BaseException as exc:  # re-raised below
            err.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if err:
        raise err[0]
    return out


def test_cp_ranks_agree_on_l3_and_a_page_needs_its_owner() -> None:
    store = MemoryStore()
    writers = _ranks(store)
    readers = _ranks(store)
    try:
        servers = [ReferenceServer(c) for c in writers]
        _both(writers, lambda r, c: servers[r].serve(1, _tokens(PROMPTS[2])))
        _both(writers, lambda r, c: (c.drain(), _wait_writes(c)))
        # rank r wrote only its own pages: positions p with p % 2 == r
        keys = sorted(store.objects)
        assert len(keys) == 8 and sum(k.endswith("/1") for k in keys) == 4
        # drop rank 1's object of position 5: pages 0..4 stay present (5 is owned by rank 1)
        victim = writers[1].l3.scheme.objects(_all_hashes(writers[1], PROMPTS[2]), range(5, 6))  # type: ignore[union-attr]
        del store.objects[victim[0].key]
        rs = [ReferenceServer(c) for c in readers]
        _both(readers, lambda r, c: rs[r].serve(2, _tokens(PROMPTS[2])))
        hits = [c.l3.metrics.l3_hit_pages for c in readers]  # type: ignore[union-attr]
        assert hits == [5, 5]
        assert tree_snapshot(readers[0]) == tree_snapshot(readers[1])
        for c, s in zip(readers, rs):
            assert s.integrity.mismatches == 0 and s.integrity.checked_units == s.integrity.expected_units > 0
            c.check_invariants()
        # a read that fails on rank 1 only (its objects vanish at the read):
        # both ranks abort at the same poll and both recompute
        for c in readers:
            evict_all_l1(c)
            evict_all_l2(c)
        store.drop_on_get = {k for k in store.objects if k.endswith("/1")}
        _both(readers, lambda r, c: rs[r].serve(3, _tokens(PROMPTS[1])))
        assert [c.l3.metrics.l3_prefetch_aborted for c in readers] == [1, 1]  # type: ignore[union-attr]
        assert tree_snapshot(readers[0]) == tree_snapshot(readers[1])
        for c, s in zip(readers, rs):
            assert s.integrity.mismatches == 0
            c.check_invariants()
    finally:
        for c in [*writers, *readers]:
            c.close()


def _all_hashes(cache: HiCache, ids: list[int]) -> Any:
    from hicache_cp.l3.keys import PositionHashes

    return PositionHashes.of(_tokens(ids), cache.layout.page_size)
