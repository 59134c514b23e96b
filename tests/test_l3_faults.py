"""Faults: the Mooncake master dies in the middle of L3 operations.

The master is a real process started by the test module (`l3env`) on a free
loopback port; the tests SIGKILL it while a prefetch read or a write-back
put is about to run (held at a gate around the real store), then check
that: nothing wrong is ever returned (every reused byte is compared with
what computing it gives), the cache keeps serving from L1 and L2, no L2
page leaks (`check_invariants` counts the tier's reservations and held
pages), counters and the store's health show the fault, and L3 resumes
once the master is back.
"""

from __future__ import annotations

import time

import pytest
from conftest import evict_all_l1, evict_all_l2, fill_pattern, run_request, tokens_of
from test_l3_support import GatedStore, flush_writes, l3_cache, l3env, until, verify_l1  # noqa: F401 - fixture

from hicache_cp.l3.client import Health
from hicache_cp.l3.ops import PrefetchState
from hicache_cp.l3.store import L3Error


def _serve(cache, ids):  # type: ignore[no-untyped-def]
    return run_request(cache, tokens_of(*ids), write=fill_pattern)


def _restart_and_resume(l3env, *caches, timeout: float = 25.0) -> None:  # type: ignore[no-untyped-def]
    """Start the master again and wait until every cache's L3 answers (probes)."""
    l3env.master.restart()
    deadline = time.monotonic() + timeout
    for c in caches:
        while c.l3.client.health is not Health.UP:
            assert time.monotonic() < deadline, f"L3 did not resume within {timeout} s"
            time.sleep(0.05)
            c.poll()


def _resumed_round_trip(l3env, writer, reader, ids) -> None:  # type: ignore[no-untyped-def]
    """After a restart the master knows no object: write again, read back."""
    deadline = time.monotonic() + 20
    while True:  # the clients remount their segments a moment after the master is back
        _serve(writer, ids)
        flush_writes(writer)
        if writer.l3.metrics.l3_put_keys:
            r = _serve(reader, ids)
            if r.m.l3_len == len(ids):
                assert verify_l1(reader, r.tokens, range(len(ids)), r.load.device_pages) == 0
                return
        assert time.monotonic() < deadline, "no L3 round trip after the master came back"
        evict_all_l1(writer)
        evict_all_l2(writer)
        evict_all_l1(reader)
        evict_all_l2(reader)
        time.sleep(0.2)


def test_master_killed_mid_prefetch(l3env) -> None:  # noqa: F811
    settings = l3env.settings()
    store = GatedStore(l3env.stores[1])
    a, b = l3_cache(l3env.stores[0], settings), l3_cache(store, settings)
    try:
        _serve(a, range(1, 9))
        flush_writes(a)
        store.get_gate.clear()
        m = b.match_prefix(tokens_of(*range(1, 9)))
        op = b.prefetch(m, wait=False)  # found and reserved: 8 L2 pages belong to the op
        assert op is not None and b.host_pool.allocator.used_pages == 8
        store.get_waiting.wait(10)
        l3env.master.kill()  # the read runs against a dead master
        store.get_gate.set()
        until(lambda: not op.active, b)
        assert op.state is PrefetchState.ABORTED and isinstance(op.error, L3Error)
        assert m.l3_len == 0 and b.stats()["l3_hit_tokens"] == 0
        b.release(m.last_node)
        assert b.host_pool.allocator.used_pages == 0  # the reservation came back
        assert b.l3.metrics.l3_failures >= 1 and b.l3.client.health is Health.DOWN
        # while it is down: requests are served from L1/L2 (and computed), no store call is made
        lookups = b.l3.metrics.l3_lookups
        t0 = time.monotonic()
        r = _serve(b, range(1, 9))
        assert time.monotonic() - t0 < 1.0 and b.l3.metrics.l3_lookups == lookups
        assert r.m.matched_pages == 0 and verify_l1(b, r.tokens, range(8), r.new) == 0
        r = _serve(b, range(1, 9))  # an L1 hit, bytes as computed
        assert r.m.device_len == 8 and verify_l1(b, r.tokens, range(8), r.m.device_pages) == 0
        b.check_invariants()
        _restart_and_resume(l3env, a, b)
        assert b.l3.metrics.l3_resumed_events >= 1
        evict_all_l1(b)
        evict_all_l2(b)
        _resumed_round_trip(l3env, a, b, range(30, 36))
        b.check_invariants()
    finally:
        store.get_gate.set()
        if not l3env.master.running:
            l3env.master.start()
        a.close()
        b.close()


def test_master_killed_mid_write_back(l3env) -> None:  # noqa: F811
    settings = l3env.settings()
    store = GatedStore(l3env.stores[0])
    a, b = l3_cache(store, settings), l3_cache(l3env.stores[1], settings)
    try:
        store.put_gate.clear()
        _serve(a, range(1, 9))  # committed in L2, its put waits at the gate holding the 8 pages
        a.settle()
        store.put_waiting.wait(10)
        evict_all_l1(a)
        evict_all_l2(a)  # out of the tree, but not freed: the put still reads them
        assert a.host_pool.allocator.used_pages == 8 and a.l3.deferred.sum() == 8
        a.check_invariants()
        l3env.master.kill()
        store.put_gate.set()  # the put runs against a dead master and fails
        until(lambda: not a.l3.writes, a)
        assert a.host_pool.allocator.used_pages == 0 and not a.l3.deferred.any()
        assert a.l3.metrics.l3_put_keys == 0 and a.l3.metrics.l3_failures >= 1
        assert a.l3.client.health is Health.DOWN
        # down: new pages are not queued for L3, requests still hit L1/L2 with the right bytes
        r = _serve(a, range(10, 16))
        a.settle()
        assert a.l3.metrics.l3_put_skipped_down == 6 and not a.l3.writes
        evict_all_l1(a)
        r = _serve(a, range(10, 16))
        assert r.m.host_len == 6 and verify_l1(a, r.tokens, range(6), r.load.device_pages) == 0
        a.check_invariants()
        _restart_and_resume(l3env, a, b)
        evict_all_l1(a)
        evict_all_l2(a)
        _resumed_round_trip(l3env, a, b, range(40, 46))
        a.check_invariants()
        b.check_invariants()
    finally:
        store.put_gate.set()
        if not l3env.master.running:
            l3env.master.start()
        a.close()
        b.close()


def test_a_peer_holding_the_objects_dies_mid_prefetch() -> None:
    """The store client that holds the objects (another process) is SIGKILLed
    while a read is about to run: the read fails at once (a transfer failure),
    the prefetch aborts on the agreed poll, its pages come back (tcp: no
    transfer outlives the call), the request computes its pages."""
    import os
    import signal
    import threading

    from hicache_harness.l3_master import MooncakeMaster, holder_process
    from hicache_cp.l3.config import L3Config
    from hicache_cp.l3.store import MooncakeStore

    with MooncakeMaster() as master, holder_process(master.address, 32 << 20) as pid:
        cfg = L3Config(backend="mooncake", master=master.address, local_buffer_bytes=0)
        stores = [MooncakeStore.open(cfg, name=f"peer test {i}") for i in range(2)]
        settings = {**cfg.__dict__, "prefetch_timeout_s": 5.0, "retry_interval_s": 0.2}
        gated = GatedStore(stores[1])
        a, b = l3_cache(stores[0], settings), l3_cache(gated, settings)
        try:
            _serve(a, range(1, 7))
            flush_writes(a)
            assert a.l3.metrics.l3_put_keys == 6
            gated.get_gate.clear()
            m = b.match_prefix(tokens_of(*range(1, 7)))
            op = b.prefetch(m, wait=False)
            assert op is not None
            gated.get_waiting.wait(10)
            os.kill(pid, signal.SIGKILL)
            gated.get_gate.set()
            until(lambda: not op.active, b)
            assert op.state is PrefetchState.ABORTED and op.quarantined and b.l3.metrics.l3_quarantined_ops == 1
            b.release(m.last_node)
            assert b.host_pool.allocator.used_pages == 0
            r = _serve(b, range(1, 7))  # served: computed, the bytes are what prefill computes
            assert r.m.l3_len == 0 and verify_l1(b, r.tokens, range(6), r.new) == 0
            b.check_invariants()
        finally:
            gated.get_gate.set()
            a.close()
            b.close()
            closers = [threading.Thread(target=st.close) for st in stores]
            for t in closers:
                t.start()
            for t in closers:
                t.join(timeout=30)


class _ClientAnswering:
    """A test double of MooncakeDistributedStore's read calls, with scripted counts
    (the real client answers a short object with TRANSFER_FAIL, never a short count:
    `test_l3_cache.py::test_a_short_object_is_a_failed_read` covers that)."""

    def __init__(self, counts: list[int], sizes: dict[str, int]) -> None:
        self.counts, self.sizes = counts, sizes

    def batch_get_into_multi_buffers(self, keys, ptrs, sizes):  # type: ignore[no-untyped-def]
        return self.counts

    def get_size(self, key: str) -> int:
        return self.sizes.get(key, -704)


def test_every_read_that_does_not_fill_its_pages_exactly_is_an_error_naming_its_key() -> None:
    from hicache_cp.l3.store import MooncakeStore, StoreCode

    keys, ptrs, sizes = ["full", "short", "failed", "other-size"], [[0x1000, 0x2000]] * 4, [[64, 32]] * 4
    client = _ClientAnswering([96, 95, int(StoreCode.INTERNAL_ERROR), int(StoreCode.TRANSFER_FAIL)], {"other-size": 48})
    errors = MooncakeStore(client, "double").get_each(keys, ptrs, sizes)
    assert errors[0] is None
    assert (errors[1].key, errors[1].details) == ("short", {"expected_bytes": 96, "got_bytes": 95})
    assert errors[2].key == "failed" and errors[2].code == StoreCode.INTERNAL_ERROR
    assert errors[3].key == "other-size" and errors[3].details == {"expected_bytes": 96, "object_bytes": 48}
    with pytest.raises(L3Error, match="short read") as caught:  # `get` raises the first, naming its key
        MooncakeStore(client, "double").get(keys, ptrs, sizes)
    assert caught.value.key == "short" and caught.value.details["keys"] == 4
