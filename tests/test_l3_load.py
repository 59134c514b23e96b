"""The L3 tier under load (issue 29, class 6): a write-back queue that holds
evicted L2 pages yields them to new backups, cross-instance hits count only
pages another instance stored, and every [l3] field reaches the run from
every source.

The cache scenarios run on the in-memory store double (`MemoryStore`) with a
gate (`PausedPuts`) that holds the put worker at a chosen moment; each test
comments the state after its steps, with invariant checks on throughout
(`debug_checks`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest

from conftest import evict_all_l1, evict_all_l2, fill_pattern, run_request, tokens_of
from test_l3_support import MemoryStore, l3_cache

from hicache_cp.config import Config
from hicache_cp.l3.config import L3Config
from hicache_cp.l3.store import L3Error, StoreCode

SETTINGS = {"backend": "mooncake", "master": "127.0.0.1:1", "prefetch_timeout_s": 10.0, "lookup_timeout_s": 5.0}


class PausedPuts(MemoryStore):
    """MemoryStore whose put call waits at `gate` (open by default), either
    before it stores anything (`stored_first=False`) or after storing (the
    objects are visible to lookups while the put worker has not reported)."""

    def __init__(self, stored_first: bool) -> None:
        super().__init__()
        self.stored_first = stored_first
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()

    def put(self, keys, ptrs, sizes):  # type: ignore[no-untyped-def]
        if self.stored_first:
            out = super().put(keys, ptrs, sizes)
        self.waiting.set()
        self.gate.wait(30)
        return out if self.stored_first else super().put(keys, ptrs, sizes)


def _serve(cache, ids):  # type: ignore[no-untyped-def]
    return run_request(cache, tokens_of(*ids), write=fill_pattern)


# ---- a write-back queue never starves L2 ---------------------------------------------------------


def test_a_backup_takes_evicted_pages_from_puts_not_started() -> None:
    """L2 of 16 pages, the queue bound at all of it. One put runs (held at the
    gate), two wait behind it, and together they hold all of L2. A new
    request's backup evicts everything, but held pages are not freed: before
    the fix the backup was skipped (its pages never got an L2 copy, nor an L3
    one). Now the two puts that have not started give their pages up."""
    store = PausedPuts(stored_first=False)
    store.gate.clear()
    cache = l3_cache(store, {**SETTINGS, "write_queue_pages": 16}, host_pages=16, l1_pages=40)
    try:
        _serve(cache, range(1, 5))  # 4 pages; their put starts and waits at the gate
        assert store.waiting.wait(10)
        _serve(cache, range(11, 17))  # 6 pages, put queued behind it
        _serve(cache, range(21, 27))  # 6 pages, queued: L2 16/16, all held
        assert cache.stats()["l2_free_pages"] == 0 and len(cache.l3.writes) == 3
        r = _serve(cache, range(31, 37))  # 6 new pages want L2
        s = cache.stats()
        assert s["backup_pages_skipped"] == 0 and s["backup_pages_wanted"] == 22
        assert s["l3_put_yielded"] == 12  # the two queued puts gave their pages up
        assert r.node.host_visible  # the new pages have their L2 copy
        cache.check_invariants()
        store.gate.set()
        cache.drain()
        s = cache.stats()
        # the running put finished and the new pages were put; the 12 yielded never were; nothing failed
        assert s["l3_put_keys"] == len(store.objects) == 4 + 6 and s["l3_failures"] == 0
        assert s["l3_write_jobs_in_flight"] == 0 and s["l3_held_pages"] == 0
        cache.check_invariants()
    finally:
        store.gate.set()
        cache.close()


def test_a_running_put_keeps_its_pages() -> None:
    """Only puts not started yield: a put the worker runs reads its pages until
    it ends, so a backup that would need them is still skipped."""
    store = PausedPuts(stored_first=False)
    store.gate.clear()
    cache = l3_cache(store, {**SETTINGS, "write_queue_pages": 8}, host_pages=8, l1_pages=40)
    try:
        _serve(cache, range(1, 9))  # 8 pages: L2 full, their put running (at the gate)
        assert store.waiting.wait(10)
        _serve(cache, range(11, 15))  # no room: the running put holds every page
        s = cache.stats()
        assert s["backup_pages_skipped"] == 4 and s["l3_put_yielded"] == 0
        store.gate.set()
        cache.drain()
        assert cache.stats()["l3_put_keys"] == 8
        cache.check_invariants()
    finally:
        store.gate.set()
        cache.close()


class InFlightPutFailure(MemoryStore):
    """MemoryStore whose puts fail with TRANSFER_FAIL: Mooncake may still be reading the pages."""

    def put(self, keys, ptrs, sizes):  # type: ignore[no-untyped-def]
        return [L3Error("put", "injected transfer failure", code=StoreCode.TRANSFER_FAIL, key=k) for k in keys]


def test_pages_a_failed_put_may_still_read_stay_held_for_the_unsafe_hold() -> None:
    cache = l3_cache(InFlightPutFailure(), {**SETTINGS, "unsafe_hold_s": 0.5})
    try:
        _serve(cache, range(1, 5))  # 4 pages committed; their put fails, its transfer may go on
        (job,) = cache.l3.writes
        deadline = time.monotonic() + 10
        while not job.future.done():
            assert time.monotonic() < deadline, "the put never returned"
            time.sleep(0.005)
        cache.poll()
        evict_all_l1(cache)
        evict_all_l2(cache)  # the nodes lose their host copies; the pages stay held (quarantined)
        assert job.active and job.quarantined and cache.host_pool.allocator.used_pages == 4
        cache.check_invariants()
        time.sleep(0.6)  # past the hold
        cache.poll()
        assert not job.active and cache.host_pool.allocator.used_pages == 0
        assert cache.stats()["l3_quarantined_ops"] == 1 and cache.stats()["l3_put_keys"] == 0
    finally:
        cache.close()


# ---- cross-instance hits -------------------------------------------------------------------------


def test_a_hit_on_a_page_this_instance_is_still_putting_is_no_cross_instance_hit() -> None:
    """One instance alone: every L3 hit is a self-hit. Its put stores the
    objects, then the worker is held before it reports; meanwhile the pages
    leave L1 and L2 and the next request finds them in L3. The old count
    (keys this instance's retired puts stored) called those 8 pages another
    instance's."""
    from hicache_harness.replay.instances import CrossInstance

    store = PausedPuts(stored_first=True)
    store.gate.clear()
    cache = l3_cache(store, SETTINGS, host_pages=32, l1_pages=40)
    tracker = CrossInstance(cache.layout.page_size)
    cache.l3.observer = tracker
    try:
        _serve(cache, range(1, 9))  # 8 pages stored in L3; the put has not reported
        assert store.waiting.wait(10)
        evict_all_l1(cache)
        evict_all_l2(cache)  # out of the tree; the pages wait for the put
        r = _serve(cache, range(1, 9))
        assert r.m.l3_len == 8  # an L3 hit on this instance's own objects
        assert tracker.as_dict()["cross_instance_hit_tokens"] == 0
        store.gate.set()
        cache.drain()  # the put reports: those keys were stored here
        assert tracker.as_dict()["cross_instance_hit_tokens"] == 0 and tracker.waiting == []
    finally:
        store.gate.set()
        cache.close()


def test_a_hit_on_a_page_another_instance_stored_counts() -> None:
    """The other side: a key this instance was putting but found present (the
    other instance stored it first) is a cross-instance hit once its put reports."""
    from hicache_harness.replay.instances import CrossInstance

    t = CrossInstance(page_size=16)
    t.on_l3_put_started(["a", "b"])
    t.on_l3_hit([("a",), ("b",), ("c",)])  # c: never put here; a, b: wait for the put
    assert t.cross_pages == 1 and len(t.waiting) == 2
    t.on_l3_put(["a", "b"], stored=["a"])  # b was present already: another instance's
    assert t.cross_pages == 2 and t.waiting == []
    t.on_l3_hit([("a",)])
    assert t.cross_pages == 2


# ---- every [l3] field from every source ------------------------------------------------------------

#: A value other than the default for every field, as TOML, as a string (env, --set) and typed.
_L3_VALUES: dict[str, tuple[str, str, Any]] = {
    "backend": ('"mooncake"', "mooncake", "mooncake"),
    "master": ('"127.0.0.1:6000"', "127.0.0.1:6000", "127.0.0.1:6000"),
    "local_hostname": ('"127.0.0.2"', "127.0.0.2", "127.0.0.2"),
    "protocol": ('"rdma"', "rdma", "rdma"),
    "device_name": ('"mlx5_0"', "mlx5_0", "mlx5_0"),
    "namespace": ('"ns"', "ns", "ns"),
    "kv_dtype": ('"fp8"', "fp8", "fp8"),
    "pages_per_object": ("3", "3", 3),
    "group_parts": ("false", "false", False),
    "write_min_hits": ("2", "2", 2),
    "write_queue_pages": ("7", "7", 7),
    "prefetch_wait": ("false", "false", False),
    "prefetch_min_pages": ("2", "2", 2),
    "prefetch_timeout_s": ("1.5", "1.5", 1.5),
    "lookup_timeout_s": ("0.25", "0.25", 0.25),
    "retry_interval_s": ("3.0", "3.0", 3.0),
    "close_timeout_s": ("4.0", "4.0", 4.0),
    "connect_timeout_s": ("6.0", "6.0", 6.0),
    "unsafe_hold_s": ("9.0", "9.0", 9.0),
    "segment_bytes": ("1048576", "1048576", 1048576),
    "local_buffer_bytes": ("2048", "2048", 2048),
}


def test_every_l3_field_has_a_case() -> None:
    assert set(_L3_VALUES) == set(L3Config.field_names())


@pytest.mark.parametrize("source", ["toml", "env", "set"])
@pytest.mark.parametrize("name", sorted(_L3_VALUES))
def test_every_l3_field_from_every_source(name: str, source: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    toml, raw, typed = _L3_VALUES[name]
    path, env, overrides = None, {}, {}
    if source == "toml":
        path = tmp_path / "c.toml"
        path.write_text(f"[l3]\n{name} = {toml}\n")
    elif source == "env":
        env = {f"HICACHE_L3_{name.upper()}": raw}
    else:
        overrides = {f"l3.{name}": raw}
    resolved = Config.resolve(path, env=env, overrides=overrides)
    assert getattr(resolved.config.l3, name) == typed
    assert default_differs(name, typed)
    report = resolved.report()["l3"]
    assert report["value"][name] == typed
    want = {"toml": f"toml:{path}", "env": f"env:HICACHE_L3_{name.upper()}", "set": "cli"}[source]
    assert report["sources"][name] == want


def default_differs(name: str, value: Any) -> bool:
    return dataclasses.asdict(L3Config())[name] != value


# ---- the default object size ----------------------------------------------------------------------


@pytest.mark.parametrize("page_size,pages", [(16, 32), (64, 8), (128, 4), (512, 1), (1024, 1), (96, 6)])
def test_default_objects_hold_at_least_512_tokens(page_size: int, pages: int) -> None:
    """Unset, `pages_per_object` is the fewest pages holding 512 tokens (the
    master's item operations per request stay ~8x below one page per object
    at page 64), and the config records the number that runs."""
    from hicache_cp.presets import PRESETS
    from hicache_cp.l3.keys import KeyScheme

    assert L3Config().pages_per_object is None
    config = Config(page_size=page_size, l3={"backend": "mooncake"})
    assert config.l3.pages_per_object == pages and pages * page_size >= 512
    assert Config.resolve(overrides={"page_size": str(page_size)}).report()["l3"]["value"]["pages_per_object"] == pages
    assert KeyScheme(PRESETS["tiny"].layout(page_size), "tiny", L3Config(), 1, 0).group == pages
    assert Config(page_size=page_size, l3={"pages_per_object": 1}).l3.pages_per_object == 1  # an explicit one wins
