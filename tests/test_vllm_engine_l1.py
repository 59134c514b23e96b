"""The cache calls the vLLM connector relies on, without vLLM: engine-owned L1.

`HiCache.reserve_host_copy` and `HiCache.load_into` (hicache_cp.cache.engine_l1)
with the CPU copy engine; the invariants are checked after every step
(`debug_checks`). Runs everywhere (no vLLM needed).
"""

from __future__ import annotations

import numpy as np
import pytest

from hicache_cp import BackupState, Config, HiCache, LoadState, Model, Part

PS = 16  # the tiny preset's page size


def run_layers(cache: HiCache, ops) -> None:
    for model in (Model.TARGET, Model.DRAFT):
        for layer in range(cache.layout.num_layers(model)):
            cache.on_layer_end(model, layer, ops)


@pytest.fixture
def cache():
    with HiCache(Config(model="tiny", page_size=PS, l1_pages=64, debug_checks=True, io_backend="cpu")) as c:
        yield c


def test_vllm_engine_l1_write_through_fills_gaps_and_loads_into_engine_pages(cache):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1000, 4 * PS)
    b = np.concatenate([a[: 2 * PS], rng.integers(1000, 2000, 2 * PS)])
    view = cache.device_pool.layer_view(Part.TARGET_KV, 0)
    view[1:9] = rng.integers(0, 255, view[1:9].shape, dtype=np.uint8)

    (op1,) = cache.reserve_host_copy(a, np.array([1, 2, 3, 4]))
    # the tree: one PENDING host-only node of 4 pages; nothing is on the device
    (op2,) = cache.reserve_host_copy(b, np.array([1, 2, 5, 6]))
    assert (op2.first_position, op2.num_pages) == (2, 2)  # pages 0-1 are a's, pending
    m = cache.match_prefix(a)
    assert m.host_len == 0  # pending copies are invisible
    cache.release(m.last_node)
    cache.abort_backup(op1)
    run_layers(cache, [op2])
    cache.settle()
    assert op1.state is BackupState.ABORTED and op2.state is BackupState.COMMITTED
    # a's pages 0-1 are now a gap (no host copy) above b's committed pages 2-3
    m = cache.match_prefix(b)
    assert m.host_len == 0  # the gap hides them: never a partial hit
    cache.release(m.last_node)
    (op3,) = cache.reserve_host_copy(b, np.array([1, 2, 5, 6]))
    assert (op3.first_position, op3.num_pages) == (0, 2)  # the gap is filled, nothing else
    run_layers(cache, [op3])
    cache.settle()
    m = cache.match_prefix(b)
    assert (m.device_len, m.host_len) == (0, 4)
    with pytest.raises(ValueError, match="not inside"):
        cache.load_into(m, np.array([20, 21, 22]), 2)
    load = cache.load_into(m, np.array([20, 21]), 2)  # vLLM already has pages 0-1
    cache.settle()
    assert load.state is LoadState.DONE
    assert (view[[20, 21]] == view[[5, 6]]).all()  # the bytes b's pages were backed up from
    cache.release(m.last_node)
    cache.check_invariants()
    assert cache.reserve_host_copy(b, np.array([1, 2, 5, 6])) == []  # everything is in L2


def test_vllm_engine_l1_backups_fail_with_the_load_they_were_computed_on(cache):
    a = np.arange(3 * PS)
    (op,) = cache.reserve_host_copy(a[: 2 * PS], np.array([1, 2]))
    run_layers(cache, [op])
    cache.settle()
    m = cache.match_prefix(a)
    cache.engine.fault = lambda d, part, layer: (_ for _ in ()).throw(RuntimeError("injected"))
    load = cache.load_into(m, np.array([7, 8]), 0)
    cache.engine.fault = None
    (after,) = cache.reserve_host_copy(a, np.array([7, 8, 9]), after=[load])
    run_layers(cache, [after])
    cache.settle()
    assert load.state is LoadState.ABORTED and after.state is BackupState.ABORTED
    cache.release(m.last_node)
    m = cache.match_prefix(a)
    assert m.host_len == 2  # the host copy the load read is still valid; page 2 is not in L2
    cache.release(m.last_node)
    cache.check_invariants()


def test_a_match_checks_host_copies_identity_from_checked_from_on():
    """An engine that holds the first pages itself loads none of them: their copies'
    identity is not checked by its match (no hashing of its own prefix at each lookup),
    and no load may read them; a stale copy from `checked_from` on still stops the match."""
    config = Config(model="tiny", page_size=PS, l1_pages=64, io_backend="cpu")  # the injected bug leaks a page
    with HiCache(config) as cache:
        a = np.arange(4 * PS)
        (op,) = cache.reserve_host_copy(a, np.array([1, 2, 3, 4]))
        run_layers(cache, [op])
        cache.settle()
        m = cache.match_prefix(a)
        held = m.host_pages.copy()
        cache.release(m.last_node)
        cache.host_pool.tags[held[1]] ^= np.uint64(1)  # page 1's L2 page now holds another copy

        m = cache.match_prefix(a, count=False, checked_from=2)
        assert (m.host_len, m.checked_from) == (4, 2)  # page 1 is the engine's own: not checked, not loaded
        assert cache.stats().get("verify_failures_l2_identity", 0) == 0
        with pytest.raises(ValueError, match="checked_from"):
            cache.load_into(m, np.array([9, 10, 11]), 1)
        load = cache.load_into(m, np.array([9, 10]), 2)
        cache.settle()
        assert load.state is LoadState.DONE
        cache.release(m.last_node)

        m = cache.match_prefix(a, count=False, checked_from=1)
        assert m.host_len == 0  # the node holding page 1 is stale from page 1 on: the match stops before it
        assert cache.stats()["verify_failures_l2_identity"] == 1
        cache.release(m.last_node)
