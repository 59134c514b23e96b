"""KV cache events from the library (`hicache_cp.events`), against the cache's own state.

The oracle rebuilds what each tier holds by walking the tree and keying every
node's pages itself (`ChainKeyer` over the root path's tokens, not the log's
memo), so a wrong, missing or early event shows as a difference between the
replayed event stream and the cache.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from conftest import PAGE, tiny_config
from events_support import SHARED_TRACE
from hicache_cp.cache import HiCache
from hicache_cp.events import AllCleared, BlockRemoved, BlockStored, ChainKeyer, Event, EventLog, Medium, Removal
from hicache_harness.engines.synthetic import ReferenceServer
from hicache_harness.trace import load_trace, request_tokens
from hicache_harness.workload import default_workload
from hicache_cp.io.base import Direction
from hicache_cp.layout import Model
from hicache_cp.radix import HostState



def resident(cache: HiCache) -> dict[Medium, set]:
    """What each tier of `cache` holds, keyed independently of the event log."""
    keyer = ChainKeyer()
    out: dict[Medium, set] = {Medium.DEVICE: set(), Medium.HOST: set()}
    stack = [(child, None) for child in cache.tree.root.children.values()]
    while stack:
        node, parent = stack.pop()
        keys = keyer.chain(parent, node.tokens, cache.layout.page_size)
        if node.device_pages is not None:
            out[Medium.DEVICE].update(keys)
        if node.host_state is HostState.COMMITTED:
            out[Medium.HOST].update(keys)
        stack.extend((c, keys[-1]) for c in node.children.values())
    return out


class Replay:
    """A router's view: the blocks per medium after applying the events in order."""

    def __init__(self) -> None:
        self.held: dict[Medium, set] = {m: set() for m in Medium}
        self.cleared = 0

    def apply(self, events: list[Event]) -> None:
        for ev in events:
            if isinstance(ev, AllCleared):
                self.cleared += 1
                for s in self.held.values():
                    s.clear()
            elif isinstance(ev, BlockStored):
                assert len(ev.tokens) == len(ev.keys) * PAGE
                self.held[ev.medium].update(ev.keys)
            else:
                missing = set(ev.keys) - self.held[ev.medium]
                assert not missing or ev.medium is Medium.STORE, f"{ev.medium}: removal of unannounced blocks"
                self.held[ev.medium].difference_update(ev.keys)


def serve_all(cache: HiCache, requests: list[np.ndarray], after: Callable[[], None] = lambda: None) -> None:
    server = ReferenceServer(cache)
    for i, tokens in enumerate(requests):
        server.serve(i, tokens)
        after()
    cache.drain()


def embedded(n: int | None = None) -> list[np.ndarray]:
    return [request_tokens(r, PAGE) for r in default_workload(seed=3)[:n]]


def trace(n: int | None) -> list[np.ndarray]:
    if SHARED_TRACE is None:
        pytest.skip("the public trace (shared/traces/synthetic_trace.jsonl beside the checkout) is not here")
    return [request_tokens(r, PAGE) for r in load_trace(SHARED_TRACE, limit=n)]


# ---- the contract, step by step -----------------------------------------------------------


def test_a_backup_is_announced_at_its_commit_and_not_before() -> None:
    log = EventLog()
    cache = HiCache(tiny_config(), events=log)
    try:
        assert log.take() == [AllCleared()]  # a new cache: nothing held
        tokens = np.arange(3 * PAGE, dtype=np.int64)
        m = cache.match_prefix(tokens)
        pages = cache.alloc_device(3, 0)
        bk = cache.reserve_backup(pages, 0)
        for model in Model:
            for layer in range(cache.layout.num_layers(model)):
                cache.on_layer_end(model, layer, [bk])
        node = cache.insert(m, pages, bk)
        # L1 holds the pages (DEVICE stored); the copy is PENDING: nothing for L2 yet.
        ev = log.take()
        assert [(type(e), e.medium) for e in ev] == [(BlockStored, Medium.DEVICE)]
        for t in bk.inflight:
            t.wait()
        assert log.take() == []  # landed but not agreed: still invisible
        cache.poll()
        (stored,) = log.take()
        assert stored.medium is Medium.HOST and len(stored.keys) == 3 and stored.parent is None
        assert stored.keys == ChainKeyer().chain(None, tokens, PAGE)
        assert np.array_equal(stored.tokens, tokens) and stored.first_position == 0
        cache.release(node)
    finally:
        cache.close()


def test_an_aborted_backup_announces_nothing() -> None:
    def fault(direction: Direction, part: object, layer: int) -> None:
        if direction is Direction.D2H and layer == 1:
            raise RuntimeError("injected copy failure")

    log = EventLog(media=[Medium.HOST])
    cache = HiCache(tiny_config(), events=log, engine_options={"fault": fault})
    try:
        serve_all(cache, embedded(20))
        assert cache.stats()["backups_aborted"] > 0 and cache.stats()["backups_committed"] == 0
        assert log.take() == [AllCleared()]
        assert not resident(cache)[Medium.HOST]
    finally:
        cache.close()


def test_a_removed_copy_is_announced_once_through_drop_host_copy() -> None:
    log = EventLog(media=[Medium.HOST])
    cache = HiCache(tiny_config(), events=log)
    try:
        serve_all(cache, [np.arange(4 * PAGE, dtype=np.int64)])
        node = next(n for n in cache.tree.nodes() if n.host_state is HostState.COMMITTED)
        keys = log.keys_of(node)
        log.take()
        cache._state.drop_host_copy(node, Removal.INTEGRITY)  # the call a failed check makes
        assert log.take() == [BlockRemoved(Medium.HOST, keys, Removal.INTEGRITY)]
        assert node.host_state is HostState.NONE and cache.host_pool.allocator.used_pages == 0
        cache.check_invariants()
    finally:
        cache.close()


def test_a_new_cache_on_the_same_log_clears_what_the_old_one_announced() -> None:
    """A reset (SGLang's flush_cache builds a new cache) or a restart: AllCleared first."""
    log = EventLog()
    replay = Replay()
    first = HiCache(tiny_config(), events=log)
    serve_all(first, embedded(10))
    first.close()
    replay.apply(log.take())
    assert replay.held[Medium.HOST] and replay.cleared == 1
    second = HiCache(tiny_config(), events=log)
    try:
        replay.apply(log.take())
        assert replay.cleared == 2 and not any(replay.held.values())
    finally:
        second.close()


def test_split_nodes_keep_their_keys() -> None:
    """A match that splits a node splits its memoised keys with it."""
    log = EventLog()
    cache = HiCache(tiny_config(), events=log)
    try:
        tokens = np.arange(4 * PAGE, dtype=np.int64)
        serve_all(cache, [tokens, np.concatenate([tokens[: 2 * PAGE], tokens[: 2 * PAGE] + 1000])])
        want = ChainKeyer().chain(None, tokens, PAGE)
        path = cache.tree.match(tokens)
        assert len(path) == 2 and [k for n in path for k in log.keys_of(n)] == want
    finally:
        cache.close()


# ---- whole workloads: the stream rebuilds every tier exactly ----------------------------


def _check_stream(cache: HiCache, log: EventLog, replay: Replay) -> None:
    replay.apply(log.take())
    want = resident(cache)
    for medium in (Medium.DEVICE, Medium.HOST):
        assert replay.held[medium] == want[medium], (
            f"{medium}: {len(replay.held[medium] - want[medium])} announced but not held, "
            f"{len(want[medium] - replay.held[medium])} held but not announced"
        )


@pytest.mark.parametrize("workload", ["embedded", "trace"])
@pytest.mark.parametrize("policy", ["write_through", "write_back_exclusive"])
def test_the_event_stream_rebuilds_l1_and_l2_exactly(workload: str, policy: str) -> None:
    requests = embedded() if workload == "embedded" else trace(None)
    extra = {"write_policy": "write_back", "l2_exclusive": True} if policy != "write_through" else {}
    log = EventLog()
    cache = HiCache(tiny_config(l1_pages=96, host_pages=192, debug_checks=False, **extra), events=log)
    replay = Replay()
    try:
        serve_all(cache, requests, after=lambda: replay.apply(log.take()))
        _check_stream(cache, log, replay)
        stats = cache.stats()
        assert stats["evictions_l2"] > 0 and stats["evictions_l1"] > 0 and stats["l2_hit_tokens"] > 0
        assert replay.held[Medium.HOST]
        assert log.blocks[("host", "removed")] >= stats["evictions_l2"]
    finally:
        cache.close()


def test_no_host_block_is_announced_before_its_copy_is_committed() -> None:
    """Checked at the moment each event is emitted (the sink runs inside the cache's call)."""
    cache_box: list[HiCache] = []
    seen = 0

    def sink(ev: Event) -> None:
        nonlocal seen
        if isinstance(ev, BlockStored) and ev.medium is Medium.HOST:
            seen += 1
            committed = resident(cache_box[0])[Medium.HOST]
            assert set(ev.keys) <= committed, "a host block announced before its copy committed"

    log = EventLog(sink=sink)
    cache = HiCache(tiny_config(l1_pages=64, host_pages=96), events=log)
    cache_box.append(cache)
    try:
        serve_all(cache, embedded(60))
        assert seen > 0
    finally:
        cache.close()


def test_cp_ranks_announce_the_same_stream() -> None:
    """Every CP rank applies the same decisions at the same step, so each rank's
    log is the same (the harness publishes rank 0's)."""
    import threading

    from conftest import TwoRankAgreement

    ags = TwoRankAgreement.pair()
    logs = [EventLog(), EventLog()]
    caches = [HiCache(tiny_config(l1_pages=48, host_pages=48, cp_size=2), agreement=ags[r], rank=r, events=logs[r])
              for r in range(2)]  # fmt: skip
    streams: list[list[tuple]] = [[], []]
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            serve_all(caches[r], embedded(40),
                      after=lambda: streams[r].extend(_comparable(e) for e in logs[r].take()))
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        assert caches[0].stats()["evictions_l2"] > 0
        assert streams[0] == streams[1] and len(streams[0]) > 10
    finally:
        for c in caches:
            c.close()


def _comparable(ev: Event) -> tuple:
    if isinstance(ev, BlockStored):
        return ("stored", ev.medium, tuple(ev.keys), ev.parent, ev.tokens.tobytes())
    if isinstance(ev, BlockRemoved):
        return ("removed", ev.medium, tuple(ev.keys))
    return ("cleared",)
