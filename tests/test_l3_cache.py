"""The L3 tier against a real Mooncake master on loopback: scenarios.

Each test comments the state after its steps. Every byte a request gets
from L3 is compared with what computing it gives, and `check_invariants`
(L2 leak check included: prefetch reservations and held pages count) runs
after every operation (`debug_checks`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

from conftest import Faults, evict_all_l1, evict_all_l2, fill_pattern, run_request, tokens_of
from test_l3_support import GatedStore, flush_writes, l3_cache, l3env, until, verify_l1  # noqa: F401 - fixture

from hicache_cp.presets import PRESETS
from hicache_cp.io.base import Direction
from hicache_cp.l3.ops import PrefetchState
from hicache_cp.l3.store import L3Error
from hicache_cp.ops import LoadState


def _serve(cache, ids):  # type: ignore[no-untyped-def]
    return run_request(cache, tokens_of(*ids), write=fill_pattern)


def test_a_page_one_cache_wrote_is_an_l3_hit_for_another(l3env) -> None:  # noqa: F811
    settings = l3env.settings()
    a, b = l3_cache(l3env.stores[0], settings), l3_cache(l3env.stores[1], settings)
    try:
        _serve(a, range(1, 11))
        flush_writes(a)  # a's 10 committed pages are in L3
        assert a.l3.metrics.l3_put_keys == 10 and a.l3.metrics.l3_put_bytes == 10 * a.layout.bytes_per_page
        r = _serve(b, range(1, 13))  # b has nothing in L1/L2: 10 pages from L3, 2 computed
        assert (r.m.device_len, r.m.host_len, r.m.l3_len) == (0, 10, 10)
        assert verify_l1(b, r.tokens, range(10), r.load.device_pages) == 0
        s = b.stats()
        assert s["l3_hit_tokens"] == 160 and s["l3_get_bytes"] == 10 * b.layout.bytes_per_page
        assert s["hit_rate"] == pytest.approx(160 / 192)
        # the fetched pages are b's L2 now: an L2 hit next time, not an L3 one
        evict_all_l1(b)
        r2 = _serve(b, range(1, 11))
        assert r2.m.l3_len == 0 and r2.m.host_len == 10
        b.check_invariants()
    finally:
        a.close()
        b.close()


def test_the_l3_hits_of_a_load_that_fails_are_misses(l3env) -> None:  # noqa: F811
    settings = l3env.settings()
    a, b = l3_cache(l3env.stores[0], settings), l3_cache(l3env.stores[1], settings)
    faults = Faults()
    faults.fail_direction, faults.fail_next = Direction.H2D, 1
    try:
        _serve(a, range(1, 11))
        flush_writes(a)  # a's 10 pages are in L3
        b.engine.fault = faults
        r = _serve(b, range(1, 13))  # 10 pages fetched from L3 into b's L2; their H2D fails
        assert r.m.l3_len == 10 and r.load.state is LoadState.ABORTED
        s = b.stats()  # the request computed all 12 pages: no hit of any tier
        assert (s["l3_hit_tokens"], s["l3_hit_pages"], s["l2_hit_tokens"], s["miss_tokens"]) == (0, 0, 0, 192)
        b.check_invariants()
    finally:
        b.engine.fault = None
        a.close()
        b.close()


def test_incompatible_layouts_never_read_each_other(l3env) -> None:  # noqa: F811
    settings = l3env.settings()
    a = l3_cache(l3env.stores[0], settings)
    state_on_odd_layers = dataclasses.replace(PRESETS["tiny"], state_layers=(1, 3))
    other = [
        l3_cache(l3env.stores[1], {**settings, "kv_dtype": "bf16"}),
        l3_cache(l3env.stores[2], settings, model_layout=state_on_odd_layers),
        l3_cache(l3env.stores[3], {**settings, "pages_per_object": 2}),
    ]
    try:
        _serve(a, range(1, 9))
        flush_writes(a)
        fps = {a.l3.scheme.fingerprint} | {c.l3.scheme.fingerprint for c in other}
        assert len(fps) == 4
        for c in other:
            r = run_request(c, tokens_of(*range(1, 9)), write=fill_pattern)
            assert r.m.l3_len == 0 and c.l3.metrics.l3_prefetch_started == 0
            assert c.l3.metrics.l3_lookup_keys > 0  # looked, under its own keys: found nothing
    finally:
        for c in [a, *other]:
            c.close()


@pytest.mark.parametrize("group,group_parts", [(4, True), (1, False), (3, False)])
def test_grouped_objects_fewer_keys_same_bytes(l3env, group: int, group_parts: bool) -> None:  # noqa: F811
    settings = l3env.settings(pages_per_object=group, group_parts=group_parts)
    a, b = l3_cache(l3env.stores[0], settings), l3_cache(l3env.stores[1], settings)
    try:
        _serve(a, range(1, 7))  # 6 pages: whole groups only
        _serve(a, range(1, 13))  # extends: the group straddling page 6 is written now
        flush_writes(a)
        parts = 1 if group_parts else len(a.layout.parts)
        assert a.l3.metrics.l3_put_keys == (12 // group) * parts
        r = _serve(b, range(1, 14))  # 13 pages: the last, partial group is not in L3
        assert r.m.l3_len == 12 // group * group
        assert verify_l1(b, r.tokens, range(r.m.l3_len), r.load.device_pages) == 0
        # b with its first page in L1 reads the groups from the page after it (a group's head is surplus)
        c = l3_cache(l3env.stores[2], settings)
        try:
            _serve(c, [1])
            r = _serve(c, range(1, 13))
            assert r.m.device_len == 1 and r.m.l3_len == 11
            assert verify_l1(c, r.tokens, range(1, 12), r.load.device_pages) == 0
            assert c.l3.metrics.l3_surplus_pages == (1 if group > 1 else 0)
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_a_page_is_present_only_with_every_part(l3env) -> None:  # noqa: F811
    settings = l3env.settings(group_parts=False)
    a, b = l3_cache(l3env.stores[0], settings), l3_cache(l3env.stores[1], settings)
    try:
        _serve(a, range(1, 9))
        flush_writes(a)
        # remove the draft state of page 5: pages 5.. are absent, 0..4 present
        objs = a.l3.scheme.objects(_hashes(a, tokens_of(*range(1, 9))), range(5, 6))
        victim = [o.key for o in objs if o.parts[0].part.value == "draft_state"]
        assert len(victim) == 1 and l3env.stores[0].client.remove(victim[0], True) == 0
        r = _serve(b, range(1, 9))
        assert r.m.l3_len == 5
        assert verify_l1(b, r.tokens, range(5), r.load.device_pages) == 0
    finally:
        a.close()
        b.close()


def _hashes(cache, tokens):  # type: ignore[no-untyped-def]
    from hicache_cp.l3.keys import PositionHashes

    return PositionHashes.of(tokens, cache.layout.page_size)


@contextlib.contextmanager
def _written_here_read_there_gated(l3env, ids, **settings):  # type: ignore[no-untyped-def]
    """Cache `a` served `ids` and put them to L3; cache `b` reads the store
    through a gate that is closed (reads wait) until the test opens it.
    Yields (a, b, gated store); opens the gate and closes both at the end."""
    store, cfg = GatedStore(l3env.stores[1]), l3env.settings(**settings)
    a = l3_cache(l3env.stores[0], cfg)
    b = l3_cache(store, cfg)
    try:
        _serve(a, ids)
        flush_writes(a)
        store.get_gate.clear()
        yield a, b, store
    finally:
        store.get_gate.set()
        a.close()
        b.close()


def test_a_key_lost_between_lookup_and_read_counts_nothing(l3env) -> None:  # noqa: F811
    with _written_here_read_there_gated(l3env, range(1, 9)) as (a, b, store):
        m = b.match_prefix(tokens_of(*range(1, 9)))
        op = b.prefetch(m, wait=False)
        assert op is not None and op.num_pages == 8
        store.get_waiting.wait(10)
        key = op.objects[3].key
        assert l3env.stores[0].client.remove(key, True) == 0  # gone after the lookup
        store.get_gate.set()
        b.settle()  # the read fails: aborted on every rank, pages released
        assert op.state is PrefetchState.ABORTED and isinstance(op.error, L3Error) and op.error.missing
        assert m.l3_len == 0 and b.stats()["l3_hit_tokens"] == 0
        b.release(m.last_node)
        b.check_invariants()
        assert b.host_pool.allocator.used_pages == 0


def test_a_short_object_is_a_failed_read(l3env) -> None:  # noqa: F811
    settings = l3env.settings()
    a, b = l3_cache(l3env.stores[0], settings), l3_cache(l3env.stores[1], settings)
    try:
        # a foreign object of half the size under the key of page 0
        key = a.l3.scheme.objects(_hashes(a, tokens_of(1, 2)), range(0, 1))[0].key
        buf = np.zeros(a.layout.bytes_per_page // 2, np.uint8)
        st = l3env.stores[0]
        st.register(buf.ctypes.data, buf.nbytes)
        assert st.put([key], [[buf.ctypes.data]], [[buf.nbytes]]) == [None]
        st.unregister(buf.ctypes.data)
        r = _serve(b, [1, 2])
        assert r.m.l3_len == 0 and b.l3.metrics.l3_prefetch_aborted == 1 and b.l3.metrics.l3_quarantined_ops == 0
        assert verify_l1(b, r.tokens, [0], r.new[:1]) == 0  # recomputed, not garbage
    finally:
        a.close()
        b.close()


def test_write_back_holds_pages_that_l2_evicts(l3env) -> None:  # noqa: F811
    store, settings = GatedStore(l3env.stores[0]), l3env.settings()
    a = l3_cache(store, settings)
    b = l3_cache(l3env.stores[1], settings)
    try:
        store.put_gate.clear()  # the put waits
        _serve(a, range(1, 9))
        a.settle()
        store.put_waiting.wait(10)
        held = a.l3.writes[0].held.copy()
        evict_all_l1(a)
        evict_all_l2(a)  # the nodes lose their host copies now, the pages stay allocated
        assert a.host_pool.allocator.used_pages == 8 and a.l3.deferred[held].all()
        a.check_invariants()
        store.put_gate.set()
        flush_writes(a)  # the put returned: pages freed
        assert a.host_pool.allocator.used_pages == 0 and not a.l3.deferred.any()
        r = _serve(b, range(1, 9))  # and what the put read was the committed bytes
        assert r.m.l3_len == 8 and verify_l1(b, r.tokens, range(8), r.load.device_pages) == 0
    finally:
        store.put_gate.set()
        a.close()
        b.close()


def test_a_full_write_queue_skips(l3env) -> None:  # noqa: F811
    store, settings = GatedStore(l3env.stores[0]), l3env.settings(write_queue_pages=10)
    a = l3_cache(store, settings)
    try:
        store.put_gate.clear()
        _serve(a, range(1, 9))  # 8 pages queued
        _serve(a, range(20, 26))  # 6 more would pass the bound of 10: skipped
        assert a.l3.metrics.l3_put_skipped_full == 6 and a.l3.queued_pages == 8
        store.put_gate.set()
        flush_writes(a)
        assert a.l3.metrics.l3_put_keys == 8
    finally:
        store.put_gate.set()
        a.close()


def test_prefetch_without_waiting_serves_the_next_request(l3env) -> None:  # noqa: F811
    with _written_here_read_there_gated(l3env, range(1, 9), prefetch_wait=False) as (a, b, store):
        r = run_request(b, tokens_of(*range(1, 9)), write=fill_pattern, stop_after="insert")
        # the request went without: it computed all 8 pages; the fetch still holds 8 L2 pages
        assert r.m.l3_len == 0 and len(r.new) == 8 and len(b.l3.prefetches) == 1
        store.get_gate.set()
        b.settle()  # fetched pages land: the nodes that had no host copy get them, the rest is surplus
        r.release()
        b.check_invariants()
        assert b.l3.metrics.l3_prefetch_committed == 1
        evict_all_l1(b)
        r2 = _serve(b, range(1, 9))
        assert r2.m.host_len == 8 and verify_l1(b, r2.tokens, range(8), r2.load.device_pages) == 0


def test_pages_a_non_waiting_prefetch_landed_are_l3_hits_of_the_request_that_uses_them(l3env) -> None:  # noqa: F811
    with _written_here_read_there_gated(l3env, range(1, 9), prefetch_wait=False) as (a, b, store):
        m = b.match_prefix(tokens_of(*range(1, 9)))  # a request that went without: 8 pages missed
        op = b.prefetch(m)
        assert op is not None and m.l3_len == 0
        b.release(m.last_node)  # it left (say L1 refused it); the fetch goes on
        store.get_gate.set()
        b.settle()  # landed on every rank: a host-only node of 8 pages, fresh from L3
        assert op.state is PrefetchState.COMMITTED and int(b.l3.hits.fresh.sum()) == 8
        b.check_invariants()
        r = _serve(b, range(1, 9))  # the first use of the landed copy: L3 hits, not L2 ones
        assert (r.m.host_len, r.m.l3_len) == (8, 8)
        assert verify_l1(b, r.tokens, range(8), r.load.device_pages) == 0
        s = b.stats()
        assert (s["l3_hit_pages"], s["l3_hit_tokens"], s["l2_hit_pages"], s["l2_hit_tokens"]) == (8, 128, 0, 0)
        assert s["hit_rate"] == pytest.approx(128 / 256) and not b.l3.hits.fresh.any()
        evict_all_l1(b)
        r2 = _serve(b, range(1, 9))  # counted once: the copy is b's L2 now
        assert (r2.m.host_len, r2.m.l3_len) == (8, 0) and b.stats()["l3_hit_pages"] == 8


def _hit_counters(cache) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The hit counters of `stats()`, checked against the Prometheus collector's."""
    from hicache_cp.prometheus import CacheCollector

    s = cache.stats()
    tiers = {f.name: f for f in CacheCollector(cache).collect()}["hicache_hit_tokens"]
    by_tier = {sample.labels["tier"]: sample.value for sample in tiers.samples if sample.name.endswith("_total")}
    assert by_tier == {"l1": s["l1_hit_tokens"], "l2": s["l2_hit_tokens"], "l3": s["l3_hit_tokens"]}
    keys = ("requests", "prompt_tokens", "l1_hit_tokens", "l2_hit_tokens", "miss_tokens", "l3_hit_tokens",
            "l3_hit_pages", "l3_prefetch_committed", "l3_prefetch_pages", "l3_surplus_pages", "hit_rate")  # fmt: skip
    return {k: s[k] for k in keys}


def test_a_queued_request_gets_what_landed_as_l3_hits_like_a_waiting_one(l3env) -> None:  # noqa: F811
    settings = l3env.settings()
    a = l3_cache(l3env.stores[0], settings)
    readers = {**settings, "write_min_hits": 1000}  # they only read: each finds exactly a's 10 pages
    waiting = l3_cache(l3env.stores[1], readers)
    queued = l3_cache(l3env.stores[2], {**readers, "prefetch_wait": False})
    try:
        _serve(a, range(1, 11))
        flush_writes(a)  # 10 pages in L3
        op = queued.prefetch_queued(tokens_of(*range(1, 13)))  # at arrival: no request counted, nothing locked
        assert op is not None and op.num_pages == 10 and queued.metrics.requests == 0
        assert queued.tree.root.lock_ref == 1 and queued.host_pool.allocator.used_pages == 10
        queued.settle()  # ...other requests compute meanwhile; it landed and committed
        assert op.state is PrefetchState.COMMITTED
        r = _serve(queued, range(1, 13))  # scheduled now: 10 pages from L3 (through L2), 2 computed
        assert (r.m.device_len, r.m.host_len, r.m.l3_len) == (0, 10, 10)
        assert verify_l1(queued, r.tokens, range(10), r.load.device_pages) == 0
        w = _serve(waiting, range(1, 13))  # the same request, waiting for its prefetch at admission
        assert (w.m.device_len, w.m.host_len, w.m.l3_len) == (0, 10, 10)
        assert _hit_counters(queued) == _hit_counters(waiting)
        assert queued.stats()["l3_hit_tokens"] == 160
        assert queued.prefetch_queued(tokens_of(*range(1, 13))) is None  # all of it is cached now
        queued.check_invariants()
    finally:
        for c in (a, waiting, queued):
            c.close()


def test_a_non_waiting_prefetch_is_not_issued_twice(l3env) -> None:  # noqa: F811
    with _written_here_read_there_gated(l3env, range(1, 9), prefetch_wait=False) as (a, b, store):
        op = b.prefetch_queued(tokens_of(*range(1, 9)))
        assert op is not None and op.state is PrefetchState.FETCHING
        # scheduled before it landed: it goes without, and no second read of the same pages starts
        m = b.match_prefix(tokens_of(*range(1, 9)))
        assert b.prefetch(m) is None and b.l3.metrics.l3_prefetch_started == 1
        b.release(m.last_node)
        store.get_gate.set()
        b.settle()
        r = _serve(b, range(1, 9))
        assert r.m.l3_len == 8 and verify_l1(b, r.tokens, range(8), r.load.device_pages) == 0


def test_cancel_releases_after_the_read_returns(l3env) -> None:  # noqa: F811
    with _written_here_read_there_gated(l3env, range(1, 5)) as (a, b, store):
        m = b.match_prefix(tokens_of(*range(1, 5)))
        op = b.prefetch(m, wait=False)
        b.cancel_prefetch(op)
        b.poll()  # agreed: failing, but the read has not returned: the pages stay reserved
        assert op.state is PrefetchState.FAILING and b.host_pool.allocator.used_pages == 4
        store.get_gate.set()
        b.settle()
        assert op.state is PrefetchState.ABORTED and b.host_pool.allocator.used_pages == 0
        assert b.l3.metrics.l3_prefetch_cancelled == 1
        b.release(m.last_node)


def test_a_prefetch_past_its_deadline_goes_without(l3env) -> None:  # noqa: F811
    with _written_here_read_there_gated(l3env, range(1, 5), prefetch_timeout_s=0.2) as (a, b, store):
        m = b.match_prefix(tokens_of(*range(1, 5)))
        op = b.prefetch(m)  # waits 0.2 s, then the agreed decision: failing
        assert op.state is PrefetchState.FAILING and m.l3_len == 0
        store.get_gate.set()
        until(lambda: op.state is PrefetchState.ABORTED, b)  # decided once the read returned
        assert b.l3.metrics.l3_prefetch_timeouts == 1
        b.release(m.last_node)
        b.check_invariants()


def test_l3_off_by_default_and_config_errors() -> None:
    from hicache_cp.config import Config
    from hicache_cp.errors import ConfigError

    assert not Config().l3.enabled
    c = Config.from_dict({"l3": {"backend": "mooncake", "master": "127.0.0.1:1234", "pages_per_object": 4}})
    assert c.l3.pages_per_object == 4 and Config.from_dict(c.to_dict()).l3 == c.l3
    for bad in ({"backend": "redis"}, {"master": "nohost"}, {"pages_per_object": 0}, {"nope": 1},
                {"prefetch_timeout_s": 0}, {"namespace": "a/b"}):  # fmt: skip
        with pytest.raises(ConfigError, match="l3"):
            Config.from_dict({"l3": bad})
