"""Verified restores in the library: every fault of issue 44 is detected, never served,
and its request recomputed; the bad L2 copy is dropped and never served again.

Each story runs the reference server (`hicache_harness.engines.synthetic`) over a real
`HiCache` on the cpu io backend, injects one fault, and then checks three
things: the library's check failed the load (`verify_failures_*`, an aborted
load), the harness's own byte oracle saw only correct bytes (the request was
recomputed, nothing corrupt was served), and a later request gets no L2 hit
from the dropped copy. The same story with `verify_restores = off` serves the
corrupt bytes (the oracle counts them): the check is what catches them.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from hicache_cp.cache import HiCache
from hicache_cp.checksum import Verify
from hicache_cp.io.base import Direction
from hicache_harness.engines.synthetic import ReferenceServer
from hicache_cp.layout import Part
from hicache_cp.radix import HostState

from conftest import PAGE, tiny_config

PAGES = 6


@pytest.fixture(autouse=True, params=["batched", "on-worker"])
def check_path(request, monkeypatch):  # type: ignore[no-untyped-def]
    """Every story on both paths of the cpu backend's checks: batched on the asking
    thread (small copies), and on the copy worker right after the copy (large ones)."""
    if request.param == "on-worker":
        monkeypatch.setattr("hicache_cp.io.cpu.WORKER_CHECK_BYTES", 0)
    return request.param


def tokens(base: int, pages: int = PAGES) -> np.ndarray:
    """A prompt of `pages` whole pages, distinct for each `base`."""
    return np.arange(base * 10_000, base * 10_000 + pages * PAGE, dtype=np.int64)


class Landed:
    """The cpu backend's `landed` hook: runs `action` once on the first copy that matches."""

    def __init__(self) -> None:
        self.when: tuple[Direction, Part, int] | None = None
        self.action: Any = None
        self.fired = 0

    def __call__(self, direction: Direction, part: Part, layer: int, dev: np.ndarray, host: np.ndarray) -> None:
        if self.when == (direction, part, layer) and self.action is not None:
            self.action(dev, host)
            self.action = None
            self.fired += 1


def make(verify: str = "all", **cfg: Any) -> tuple[HiCache, ReferenceServer, Landed]:
    landed = Landed()
    config = tiny_config(l1_pages=64, host_pages=64, verify_restores=verify, **cfg)
    cache = HiCache(config, engine_options={"landed": landed})
    return cache, ReferenceServer(cache, verify=True), landed


def host_pages_of(cache: HiCache, prompt: np.ndarray) -> np.ndarray:
    """The logical L2 pages of the committed copy of `prompt` (all its nodes)."""
    path = cache.tree.match(prompt)
    assert path and all(n.host_state is HostState.COMMITTED for n in path), path
    return np.concatenate([n.host_pages for n in path])


def physical(cache: HiCache, pages: np.ndarray) -> np.ndarray:
    return pages  # cp_size 1: logical == physical


def reload(cache: HiCache, server: ReferenceServer, request: int, prompt: np.ndarray) -> Any:
    """Make `prompt` L2-only, then serve it again (an L2 hit, loaded back)."""
    cache.evict_device()
    return server.serve(request, prompt)


def assert_caught(cache: HiCache, server: ReferenceServer, prompt: np.ndarray, part: str, request: int) -> None:
    """The load failed the check and aborted; the oracle saw only correct bytes;
    the copy is gone; a later reload computes the pages (no L2 hit from it)."""
    stats = cache.stats()
    assert stats["loads_aborted"] == 1, stats
    assert stats[f"verify_failures_l2_{part}"] >= 1, stats
    assert stats["integrity_dropped_pages"] == PAGES
    assert server.integrity.mismatches == 0 and server.integrity.complete  # nothing corrupt was served
    again = reload(cache, server, request + 1, prompt)
    assert again.l2_hit_pages == 0 and again.computed_pages == PAGES  # never served again
    assert server.integrity.mismatches == 0
    cache.drain()
    cache.check_invariants()


def flip_host_bit(cache: HiCache, prompt: np.ndarray, part: Part = Part.TARGET_KV, layer: int = 1) -> None:
    page = host_pages_of(cache, prompt)[2]
    view = cache.host_pool.layer_view(part, cache.layout.part(part).slot(layer))
    view[page, 5] ^= 0x10


def test_a_flipped_bit_in_host_memory_is_caught_and_the_request_recomputed(caplog) -> None:
    cache, server, _ = make()
    with cache:
        prompt = tokens(1)
        server.serve(0, prompt)
        flip_host_bit(cache, prompt)
        with caplog.at_level(logging.WARNING):
            r = reload(cache, server, 1, prompt)
        assert r.l2_hit_pages == PAGES  # matched as a hit, then re-counted as a miss
        warned = [rec.getMessage() for rec in caplog.records if rec.name == "hicache_cp.io.verify"]
        assert len(warned) == 1, warned  # one warning for the failure, naming where it is
        assert "pages=[3]" in warned[0], warned[0]
        for field in ("tier=l2", "request=1", "part=target_kv", "layer=1", "rank=0", "pages="):
            assert field in warned[0], warned[0]
        assert_caught(cache, server, prompt, "target_kv", 1)


def test_without_checks_the_same_flip_is_served() -> None:
    """The control: with verify_restores = off the load succeeds and the oracle
    finds the corrupt unit the check would have caught."""
    cache, server, _ = make("off")
    with cache:
        prompt = tokens(1)
        server.serve(0, prompt)
        flip_host_bit(cache, prompt)
        reload(cache, server, 1, prompt)
        assert cache.stats()["loads_aborted"] == 0
        assert server.integrity.mismatches == 1


def test_a_torn_backup_is_caught_at_load() -> None:
    """The copy of one layer is only half written when it is marked done: the checksum
    was taken from the device pages it read, so the load sees the torn half."""
    cache, server, landed = make()
    with cache:
        landed.when = (Direction.D2H, Part.TARGET_STATE, 2)
        half = cache.layout.part(Part.TARGET_STATE).page_bytes // 2

        def tear(dev: np.ndarray, host: np.ndarray) -> None:
            view = cache.host_pool.layer_view(Part.TARGET_STATE, cache.layout.part(Part.TARGET_STATE).slot(2))
            view[host[1], half:] = 0  # the rest never landed

        landed.action = tear
        prompt = tokens(2)
        server.serve(0, prompt)
        assert landed.fired == 1 and cache.stats()["backups_committed"] == 1
        reload(cache, server, 1, prompt)
        assert_caught(cache, server, prompt, "target_state", 1)


def test_a_load_racing_a_forward_write_to_the_same_slots_is_caught() -> None:
    """A forward writes into the L1 pages a load is filling (two owners of one page):
    the check of what landed sees the forward's bytes."""
    cache, server, landed = make()
    with cache:
        prompt = tokens(3)
        server.serve(0, prompt)
        landed.when = (Direction.H2D, Part.DRAFT_KV, 0)

        def forward_writes(dev: np.ndarray, host: np.ndarray) -> None:
            cache.device_pool.layer_view(Part.DRAFT_KV, 0)[dev[3]] = 0x77

        landed.action = forward_writes
        reload(cache, server, 1, prompt)
        assert landed.fired == 1
        assert_caught(cache, server, prompt, "draft_kv", 1)


def test_a_stale_page_reused_after_eviction_is_caught() -> None:
    """The tree still names L2 pages that were freed and reused by another copy (a
    use-after-free): the bytes and their checksums are the other copy's, consistent
    with each other, but the identity tag is not this prefix's."""
    cache, server, _ = make(debug_checks=False)  # the injected bug breaks the leak invariant on purpose
    with cache:
        a, b = tokens(4), tokens(5)
        server.serve(0, a)
        stale = host_pages_of(cache, a)
        cache._state.free_host_pages(stale)  # the bug: freed behind the tree's back
        server.serve(1, b)  # its backup reuses them
        assert set(host_pages_of(cache, b).tolist()) == set(stale.tolist())
        r = reload(cache, server, 2, a)
        stats = cache.stats()  # refused at match: no hit, no load, the copy dropped
        assert r.l2_hit_pages == 0 and stats["loads_started"] == 0 and stats["verify_failures_l2_identity"] == PAGES
        assert stats["integrity_dropped_pages"] == PAGES and server.integrity.mismatches == 0
        assert all(n.host_state is HostState.COMMITTED for n in cache.tree.match(b))  # b's copy stays
        assert not set(host_pages_of(cache, a).tolist()) & set(stale.tolist())  # a was backed up afresh
        again = reload(cache, server, 3, a)  # and that fresh copy serves
        assert again.l2_hit_pages == PAGES and cache.stats()["verify_failures"] == PAGES
        assert server.integrity.mismatches == 0
        cache.drain()
        cache.check_invariants()  # one owner per page again: the stale name is gone, b kept its pages


def test_a_draft_part_from_another_requests_copy_is_caught() -> None:
    """The draft KV bytes of one page come from another request's copy while the
    target parts are right: a target-only check would pass it."""
    cache, server, _ = make()
    with cache:
        a, b = tokens(6), tokens(7)
        server.serve(0, a)
        server.serve(1, b)
        pa, pb = host_pages_of(cache, a), host_pages_of(cache, b)
        view = cache.host_pool.layer_view(Part.DRAFT_KV, 0)
        view[pa[4]] = view[pb[4]]
        reload(cache, server, 2, a)
        assert_caught(cache, server, a, "draft_kv", 2)


def test_sample_mode_checks_a_share_of_each_load() -> None:
    cache, server, _ = make("sample")
    with cache:
        prompt = tokens(8, pages=16)
        server.serve(0, prompt)
        for part in cache.layout.parts:  # every page corrupt: a sample must catch it
            for slot in range(part.num_slots):
                cache.host_pool.layer_view(part.part, slot)[host_pages_of(cache, prompt), 0] ^= 1
        reload(cache, server, 1, prompt)
        stats = cache.stats()
        assert stats["loads_aborted"] == 1
        units = sum(p.num_slots for p in cache.layout.parts)
        assert 0 < stats["verified_units"] < 16 * units  # a sample, not every page
        assert server.integrity.mismatches == 0


def test_clean_restores_are_counted_and_pass() -> None:
    cache, server, _ = make()
    with cache:
        prompt = tokens(9)
        server.serve(0, prompt)
        r = reload(cache, server, 1, prompt)
        stats = cache.stats()
        units = sum(p.num_slots for p in cache.layout.parts)
        assert r.l2_hit_pages == PAGES and stats["loads_done"] == 1 and stats["loads_aborted"] == 0
        assert stats["verified_units"] == PAGES * units and stats["verified_pages"] == PAGES
        assert stats["verify_failures"] == 0 and server.integrity.mismatches == 0


def test_verify_off_keeps_no_checksums() -> None:
    cache, _, _ = make("off")
    with cache:
        assert not cache.host_pool.has_checksums and cache.engine.verify is Verify.OFF


# ---- L3: checked before an object becomes an L2 copy -------------------------------------------


@pytest.mark.parametrize("verify", ["all", "off"])
def test_a_flipped_bit_in_an_l3_object_is_caught_before_it_becomes_an_l2_copy(verify: str) -> None:
    """Cache a writes four pages to L3; the last page's object gets a flipped bit in
    the store; cache b's prefetch reads them, the check on the get fails, the
    prefetch aborts on every rank and b computes the pages (no L3 hit, no L2 copy).
    With the checks off the flipped bit is served (the control)."""
    from conftest import fill_pattern, run_request, tokens_of
    from test_l3_support import MemoryStore, flush_writes, l3_cache, verify_l1

    from hicache_cp.l3.keys import PositionHashes

    store = MemoryStore()
    a, b = (l3_cache(store, {}, verify_restores=verify) for _ in range(2))
    try:
        prompt = tokens_of(1, 2, 3, 4)
        run_request(a, prompt, write=fill_pattern)
        flush_writes(a)
        assert len(store.objects) == 4
        key = a.l3.scheme.objects(PositionHashes.of(prompt, PAGE), range(3, 4))[0].key
        data = bytearray(store.objects[key])
        data[100] ^= 0x08  # target_kv, layer 0
        store.objects[key] = bytes(data)
        r = run_request(b, prompt, write=fill_pattern)
        s = b.stats()
        if verify == "off":
            assert r.m.l3_len == 4 and verify_l1(b, r.tokens, range(4), r.load.device_pages) == 1
            return
        assert s["l3_prefetch_aborted"] == 1 and s["l3_prefetch_committed"] == 0
        assert r.m.l3_len == 0 and r.m.host_len == 0  # nothing fetched became a hit
        assert s["verify_failures"] == 1 and s["verify_failures_l3_target_kv"] == 1
        assert s["verified_units_l3"] > 0
        assert verify_l1(b, r.tokens, range(4), r.new) == 0  # computed, right
        b.check_invariants()
        # The clean objects still serve: a fresh reader of the first pages gets L3 hits.
        c = l3_cache(store, {})
        try:
            r2 = run_request(c, tokens_of(1, 2), write=fill_pattern)
            assert r2.m.l3_len == 2 and c.stats()["verify_failures"] == 0
            assert verify_l1(c, r2.tokens, range(2), r2.load.device_pages) == 0
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_verify_restores_is_checked_and_read_from_every_source(tmp_path) -> None:
    from hicache_cp.config import Config
    from hicache_cp.errors import ConfigError

    with pytest.raises(ConfigError, match="verify_restores: unknown value 'maybe'; allowed: all, sample, off"):
        Config(verify_restores="maybe")
    resolved = Config.resolve(env={"HICACHE_VERIFY_RESTORES": "sample"})
    assert resolved.config.verify_restores is Verify.SAMPLE and resolved.sources["verify_restores"].startswith("env:")
    toml = tmp_path / "c.toml"
    toml.write_text('verify_restores = "off"\n')
    assert Config.load(toml).verify_restores is Verify.OFF
    with pytest.raises(ConfigError, match=r"verify_restores.*\(from env:HICACHE_VERIFY_RESTORES\)"):
        Config.resolve(env={"HICACHE_VERIFY_RESTORES": "some"})
    assert Config(verify_restores="all").to_dict()["verify_restores"] == "all"


def test_a_stale_page_in_a_later_node_of_the_continuation_cuts_the_match_there() -> None:
    """The host continuation spans two nodes and only the second names a page that holds
    another copy: the match keeps the first node's pages (a hit), drops the second's
    copy."""
    cache, server, _ = make(debug_checks=False)  # the injected bug leaves a page no node owns
    with cache:
        whole = tokens(4)
        server.serve(0, whole[: 3 * PAGE])  # first node: pages 0-2
        server.serve(1, whole)  # second node: pages 3-5
        path = cache.tree.match(whole)
        assert [n.num_pages for n in path] == [3, 3]
        first, second = path[0].host_pages.copy(), path[1].host_pages.copy()
        cache.host_pool.tags[second[1]] ^= np.uint64(1)  # the bug: page 4's L2 page holds another copy
        r = reload(cache, server, 2, whole)
        stats = cache.stats()
        assert r.l2_hit_pages == 3 and stats["verify_failures_l2_identity"] == 1
        kept = cache.tree.match(whole)[0]
        assert kept.host_state is HostState.COMMITTED and np.array_equal(kept.host_pages[:3], first)
        assert stats["integrity_dropped_pages"] == 3 and server.integrity.mismatches == 0
