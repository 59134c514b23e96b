"""KV events of the L3 tier (medium STORE) and of L2 copies an L3 prefetch landed.

The store is `MemoryStore` (test_l3_support): what it holds is the oracle.
A page is in L3 when every object of this rank holding it exists; the event
stream must name exactly those pages, keyed like the cache's other tiers.
"""

from __future__ import annotations

import pytest

from conftest import PAGE, tiny_config
from test_events import Replay, resident
from test_l3_stateful import _l3 as l3_settings  # the [l3] settings of the MemoryStore tests
from test_l3_stateful import _tokens as tokens_of  # one token id repeated per page
from test_l3_support import MemoryStore

from hicache_cp.cache import HiCache
from hicache_cp.events import ChainKeyer, EventLog, Medium
from hicache_harness.engines.synthetic import ReferenceServer
from hicache_cp.l3.keys import PositionHashes

PROMPTS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [1, 2, 17, 18], [9, 10, 11, 19]]


def in_store(cache: HiCache, store: MemoryStore, prompts: list[list[int]]) -> set:
    """Keys of the pages of `prompts` whose objects (this rank's) all exist in the store."""
    scheme = cache.l3.scheme  # type: ignore[union-attr]
    out = set()
    for ids in prompts:
        tokens = tokens_of(ids)
        keys = ChainKeyer().chain(None, tokens, PAGE)
        hashes = PositionHashes.of(tokens, PAGE)
        g = scheme.group
        for k in range(len(ids) // g):
            objects = scheme.objects(hashes, range(k, k + 1))
            if objects and all(o.key in store.objects for o in objects):
                out.update(keys[k * g : (k + 1) * g])
    return out


def settle_writes(cache: HiCache) -> None:
    for _ in range(10_000):
        cache.settle()
        if not cache.l3.writes:  # type: ignore[union-attr]
            return
    raise AssertionError("write-back did not finish")


def evict_everything(cache: HiCache) -> None:
    cache.evict_device()
    cache._evictor.make_room("l2", cache.host_pool.allocator.capacity, 0)  # noqa: SLF001 - L2 pressure, all of it
    settle_writes(cache)


@pytest.mark.parametrize("group,group_parts", [(1, False), (2, True)])
def test_store_events_rebuild_what_the_store_holds(group: int, group_parts: bool) -> None:
    store = MemoryStore()
    log = EventLog()
    cache = HiCache(tiny_config(l1_pages=24, host_pages=16, l3=l3_settings(pages_per_object=group,
                                group_parts=group_parts)), l3_store=store, events=log)  # fmt: skip
    replay = Replay()
    try:
        server = ReferenceServer(cache)
        for i, ids in enumerate(PROMPTS * 2):
            server.serve(i, tokens_of(ids))
            settle_writes(cache)
            replay.apply(log.take())
        evict_everything(cache)
        for i, ids in enumerate(PROMPTS):  # from L3 now: prefetched copies become L2 copies
            server.serve(100 + i, tokens_of(ids))
            settle_writes(cache)
        cache.drain()
        replay.apply(log.take())
        assert cache.l3.metrics.l3_hit_pages > 0 and server.integrity.mismatches == 0  # type: ignore[union-attr]
        want = in_store(cache, store, PROMPTS)
        assert replay.held[Medium.STORE] == want and want
        assert replay.held[Medium.HOST] == resident(cache)[Medium.HOST]

        # The store evicts an object on its own: the next lookup that meets it says so.
        victim = sorted(store.objects)[0]
        del store.objects[victim]
        evict_everything(cache)
        for i, ids in enumerate(PROMPTS):
            server.serve(200 + i, tokens_of(ids))
            settle_writes(cache)
        cache.drain()
        replay.apply(log.take())
        assert log.blocks[("store", "removed")] > 0
        assert replay.held[Medium.STORE] == in_store(cache, store, PROMPTS)
    finally:
        cache.close()


def test_a_failed_put_announces_nothing() -> None:
    store = MemoryStore()
    log = EventLog(media=[Medium.STORE])
    cache = HiCache(tiny_config(l3=l3_settings()), l3_store=store, events=log)
    try:
        store.down = True
        ReferenceServer(cache).serve(0, tokens_of(PROMPTS[0]))
        settle_writes(cache)
        assert not store.objects and log.take()[1:] == []  # only the start's AllCleared
    finally:
        cache.close()
