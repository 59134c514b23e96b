"""L3 visibility and hit accounting, deterministic (issue 48, item 6), against a real
Mooncake master on loopback.

* a `prefetch_wait = false` prefetch whose read is held in flight stays invisible
  to `match_prefix` until the read returned on every rank: here, until it returned
  on this rank (the store's reads wait at a gate) and then until the agreement says
  the other rank's returned too (`OtherRankCopying`);
* an evicted L2 page loses its "landed by L3" mark: pages a non-waiting prefetch
  landed, evicted before any use, then reused for a computed request's copies,
  are L2 hits of the next request, never L3 ones.
"""

from __future__ import annotations

import time

import numpy as np

from conftest import evict_all_l1, evict_all_l2, fill_pattern, run_request, tokens_of
from test_cache_round4 import OtherRankCopying
from test_l3_support import GatedStore, flush_writes, l3_cache, l3env, verify_l1  # noqa: F401 - fixture

from hicache_cp.l3.ops import PrefetchState


def _visible(cache, ids) -> int:  # type: ignore[no-untyped-def]
    """Pages `match_prefix` returns for `ids` (device and host), the lock given back."""
    m = cache.match_prefix(tokens_of(*ids))
    cache.release(m.last_node)
    return m.device_len + m.host_len


def test_a_non_waiting_prefetch_is_invisible_until_its_read_returned_on_every_rank(l3env) -> None:  # noqa: F811
    settings = l3env.settings(prefetch_wait=False)
    store, agreement = GatedStore(l3env.stores[1]), OtherRankCopying()
    a = l3_cache(l3env.stores[0], settings)
    b = l3_cache(store, settings)
    b._state.agreement = agreement  # this rank of a CP group; the double stands for the other rank
    try:
        run_request(a, tokens_of(*range(1, 9)), write=fill_pattern)
        flush_writes(a)  # 8 pages in L3
        store.get_gate.clear()
        op = b.prefetch_queued(tokens_of(*range(1, 9)))
        assert op is not None and op.state is PrefetchState.FETCHING and op.num_pages == 8
        b.poll()
        assert _visible(b, range(1, 9)) == 0  # the read is held: nothing landed
        agreement.copying = True
        store.get_gate.set()
        deadline = time.monotonic() + 20
        while not (op.future is not None and op.future.done()):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        b.poll()
        b.poll()
        assert op.state is PrefetchState.FETCHING, "committed while another rank's read was in flight"
        assert _visible(b, range(1, 9)) == 0
        agreement.copying = False
        b.poll()  # every rank's read returned: committed, visible at once, all of it
        assert op.state is PrefetchState.COMMITTED and _visible(b, range(1, 9)) == 8
        r = run_request(b, tokens_of(*range(1, 9)), write=fill_pattern)
        assert r.m.host_len == 8 and verify_l1(b, r.tokens, range(8), r.load.device_pages) == 0
        b.check_invariants()
    finally:
        store.get_gate.set()
        a.close()
        b.close()


def test_an_evicted_l2_page_loses_its_l3_mark(l3env) -> None:  # noqa: F811
    settings = l3env.settings(prefetch_wait=False)
    a = l3_cache(l3env.stores[0], settings)
    b = l3_cache(l3env.stores[1], {**settings, "write_min_hits": 1000})  # b only reads L3
    try:
        run_request(a, tokens_of(*range(1, 9)), write=fill_pattern)
        flush_writes(a)
        op = b.prefetch_queued(tokens_of(*range(1, 9)))
        assert op is not None
        b.settle()
        assert op.state is PrefetchState.COMMITTED and int(b.l3.hits.fresh.sum()) == 8
        landed = np.sort(op.host_pages)
        evict_all_l2(b)  # nobody used them: their copies leave the tree, and their marks with them
        assert not b.l3.hits.fresh.any()
        b.check_invariants()
        r = run_request(b, tokens_of(*range(101, 109)), write=fill_pattern)  # computed: its copies reuse the pages
        assert r.bk is not None and np.array_equal(np.sort(r.bk.host_pages), landed)
        evict_all_l1(b)
        before = b.stats()["l3_hit_pages"]
        r2 = run_request(b, tokens_of(*range(101, 109)), write=fill_pattern)
        assert (r2.m.host_len, r2.m.l3_len) == (8, 0)  # L2 hits: those pages never came from L3
        assert b.stats()["l3_hit_pages"] == before
        b.check_invariants()
    finally:
        a.close()
        b.close()
