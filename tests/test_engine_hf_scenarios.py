"""Scenario tests of the real engine's scheduler: the batching paths of the cache protocol.

Each test drives `Scheduler.serve` with a tiny DeepSeek-V3.2 (transformers,
random weights) over a cache with invariant checks on and the CPU io backend
(whose `fault` hook slows or fails copies), and checks both oracles: the
bytes of every reused page against the digests recorded when they were
computed, and each request's last-token logits against the model's own
full forward.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers", minversion="5.20")

from conftest import Faults, evict_all_l1  # noqa: E402
from hicache_cp.cache import HiCache  # noqa: E402
from hicache_cp.config import Config  # noqa: E402
from hicache_harness.engines import hf_model  # noqa: E402
from hicache_harness.engines.hf_forward import PagedForward  # noqa: E402
from hicache_harness.engines.hf_oracle import recompute_logits  # noqa: E402
from hicache_harness.engines.scheduler import SHORT_STREAK, Order, Scheduler, SchedulerOptions, ServeResult  # noqa: E402
from hicache_harness.trace import TraceRequest  # noqa: E402
from hicache_cp.io.base import Direction  # noqa: E402
from hicache_cp.layout import Model, Part  # noqa: E402
from hicache_cp.pools import DevicePool  # noqa: E402
from hicache_cp.radix import HostState  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def model() -> hf_model.HfModel:
    return hf_model.build("tiny")


@dataclass
class Server:
    cache: HiCache
    sched: Scheduler
    faults: Faults

    def serve(self, *prompts: np.ndarray, first: int = 0) -> ServeResult:
        work = [(TraceRequest(first + i, 0.0, len(p), 1, (first + i,)), p) for i, p in enumerate(prompts)]
        return self.sched.serve(work)


@pytest.fixture
def server(model: hf_model.HfModel) -> Iterator[Any]:
    made: list[HiCache] = []

    def make(*, l1_pages: int = 80, host_pages: int = 80, chunk: int = 64, batch: int = 256,
             order: Order = Order.SHORT_FIRST, verify_restores: str = "all") -> Server:  # fmt: skip
        ps = model.preset.page_size
        layout = model.model_layout()
        bpp = layout.layout(ps).bytes_per_page
        cfg = Config(model="tiny", model_layout=layout, page_size=ps, l1_pages=l1_pages,
                     host_budget_bytes=(host_pages + 1) * bpp, l1_free_room=0, l2_free_room=0,
                     debug_checks=True, io_backend="cpu", pin_host=False, verify_restores=verify_restores)  # fmt: skip
        buffers = model.kv_buffers(l1_pages)
        cache = HiCache(cfg, device_pool=DevicePool(cfg.layout(), l1_pages, buffers=buffers))
        faults = Faults()
        cache.engine.fault = faults  # type: ignore[attr-defined]
        made.append(cache)
        options = SchedulerOptions(chunk_tokens=chunk, max_batch_tokens=batch, order=order)
        sched = Scheduler(cache, PagedForward(model), buffers, options)
        return Server(cache, sched, faults)

    yield make
    for c in made:
        c.engine.fault = None  # type: ignore[attr-defined]
        c.close()


def prompt(seed: int, pages: int, page_size: int = 8, tail: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, pages * page_size + tail)


def assert_outputs(model: hf_model.HfModel, result: ServeResult, prompts: dict[int, np.ndarray]) -> None:
    for request, ids in prompts.items():
        err = float((result.logits[request] - recompute_logits(model.target, ids)).abs().max())
        assert err < TOL, (request, err)


def assert_clean(s: Server, result: ServeResult) -> None:
    t = result.integrity
    assert t.mismatches == 0, [str(m) for m in t.examples]
    assert t.checked_units == t.expected_units
    s.cache.drain()
    s.cache.check_invariants()


def test_waits_on_another_requests_load_in_the_same_batch(model: hf_model.HfModel, server: Any) -> None:
    """B loads a prefix back from L2; C, admitted right after into the same
    forward, finds the loading pages as its device prefix and waits on B's load
    per layer; both read the restored KV and give the recompute's logits."""
    s = server()
    x = prompt(1, 6)
    s.serve(x)  # A computes x; its backup commits
    evict_all_l1(s.cache)  # x lives in L2 only
    b, c = np.concatenate([x, prompt(2, 2)]), np.concatenate([x, prompt(3, 2, tail=3)])
    # Both are admitted before the forward, and loads are decided only at its end:
    # C's match surely finds B's load in flight, whatever the copy timing.
    result = s.serve(b, c, first=1)
    rb, rc = (next(r for r in result.records if r.request == i) for i in (1, 2))
    assert rb.l2_hit_pages == 6 and rb.l1_hit_pages == 0
    assert rc.l1_hit_pages == 6 and rc.waited_loads == 1  # C's device prefix is B's load
    assert rb.first_forward == rc.first_forward  # one forward
    assert result.integrity.checked_l2_units > 0
    assert_outputs(model, result, {1: b, 2: c})
    assert_clean(s, result)


def test_a_request_scheduled_without_the_loader_still_waits_on_its_load(model: hf_model.HfModel, server: Any) -> None:
    """B loads a prefix back from L2 and C's device prefix is that load; both are
    admitted, and short-first runs C (a 3-token tail) alone, before B's long prefill.
    C's forward waits on B's load per layer although B is not in it; the copies are
    slow, so reading early would show."""
    s = server()
    x = prompt(4, 6)
    s.serve(x)
    evict_all_l1(s.cache)
    b, c = np.concatenate([x, prompt(5, 5)]), np.concatenate([x, prompt(6, 0, tail=3)])

    def slow_load(direction: Direction, part: Part, layer: int) -> None:
        if direction is Direction.H2D:
            time.sleep(0.05)

    s.cache.engine.fault = slow_load  # type: ignore[attr-defined]
    result = s.serve(b, c, first=1)
    rb, rc = (next(r for r in result.records if r.request == i) for i in (1, 2))
    assert rb.l2_hit_pages == 6 and rc.l1_hit_pages == 6 and rc.waited_loads == 1
    assert rc.first_forward < rb.first_forward  # C's forward ran without B
    assert_outputs(model, result, {1: b, 2: c})
    assert_clean(s, result)


def test_load_abort_recomputes_under_batching(model: hf_model.HfModel, server: Any) -> None:
    """B's load fails (an injected H2D fault): B recomputes the loaded pages and
    what it computed on them, then calls recomputed(); C waited on that load in
    the same forward, so its prefix failed: it gives its pages back and matches
    again. Both end with the recompute's logits; nothing garbage is cached."""
    s = server()
    x = prompt(4, 6)
    s.serve(x)
    evict_all_l1(s.cache)
    s.faults.fail_direction = Direction.H2D
    s.faults.fail_next = 1
    b, c = np.concatenate([x, prompt(5, 2)]), np.concatenate([x, prompt(6, 1)])
    result = s.serve(b, c, first=1)
    rb, rc = (next(r for r in result.records if r.request == i) for i in (1, 2))
    assert s.cache.metrics.loads_aborted == 1
    assert rb.redone and rb.reused_pages == 0  # nothing of B's prefix came from the cache in the end
    assert rc.restarts == 1 and rc.served
    assert_outputs(model, result, {1: b, 2: c})
    assert_clean(s, result)
    # After the dust settles the cache serves x correctly to a newcomer, from L1 or L2.
    again = s.serve(np.concatenate([x, prompt(7, 1)]), first=3)
    assert again.records[-1].request == 3 and again.records[-1].reused_pages >= 6
    assert_outputs(model, again, {3: np.concatenate([x, prompt(7, 1)])})
    assert_clean(s, again)


def test_backups_in_a_batch_fire_per_layer_in_forward_order(model: hf_model.HfModel, server: Any) -> None:
    """Four requests in one forward: each one's backup is submitted by the layer
    hooks, layer by layer (target layers in order, then the draft layer), all
    commit, and after L1 eviction every page comes back from L2 byte-identical."""
    s = server()
    prompts = {i: prompt(10 + i, 4) for i in range(4)}
    result = s.serve(*prompts.values())
    assert result.batches.max_batch_requests == 4 and result.batches.forwards == 1
    assert s.cache.metrics.backups_committed == 4
    d2h = [(part.model, layer) for d, part, layer in s.faults.seen if d is Direction.D2H]
    order = [(0 if m is Model.TARGET else 1, layer) for m, layer in d2h]
    assert order == sorted(order)  # layer i's copies start before layer i+1's, target before draft
    per_layer = {key: order.count(key) for key in set(order)}
    assert set(per_layer.values()) == {4 * 2}  # each layer: 4 backups x (KV + indexer) parts
    evict_all_l1(s.cache)
    again = s.serve(*prompts.values(), first=4)
    assert [r.l2_hit_pages for r in again.records[4:]] == [4] * 4  # records are cumulative
    assert again.integrity.checked_l2_units == 4 * 4 * s.sched.digester.num_units
    assert_outputs(model, again, {4 + i: p for i, p in prompts.items()})
    assert_clean(s, again)


def test_chunked_prefill_over_a_loading_prefix(model: hf_model.HfModel, server: Any) -> None:
    """A long request in 3 chunks on an L2 prefix: the load is waited on in the
    first chunk's forward, the backup's hooks fire only in the last, and a fully
    cached prompt still computes its last token. Each chunk also recomputes the
    position before its first new one (the MTP draft needs its hidden state)."""
    s = server(chunk=16, batch=32)
    x = prompt(20, 4)
    s.serve(x)
    evict_all_l1(s.cache)
    long = np.concatenate([x, prompt(21, 5, tail=2)])  # 4 cached pages + 42 tokens
    before = s.sched.stats.forwards
    result = s.serve(long, first=1)
    rec = result.records[-1]
    assert rec.l2_hit_pages == 4 and rec.computed_tokens == 42 + 3
    assert result.batches.forwards - before == 3  # 1 + 16, 1 + 16, 1 + 10 tokens (stats are cumulative)
    assert s.cache.metrics.backups_committed == 2
    full = s.serve(long[: 9 * 8], first=2)  # every page cached: computes the last token only
    assert full.records[-1].computed_tokens == 1
    assert_outputs(model, full, {2: long[: 9 * 8]})
    assert_outputs(model, result, {1: long})
    assert_clean(s, full)


def test_a_corrupted_host_page_is_caught_and_named(model: hf_model.HfModel, server: Any) -> None:
    """One byte flipped in L2 (target state, layer 1, page 3): the request that
    loads it back reports exactly that unit, restored from L2 (the engine's own
    check: the library's restore checks, off here, would refuse the load first)."""
    s = server(verify_restores="off")
    x = prompt(30, 6)
    s.serve(x)
    evict_all_l1(s.cache)
    node = next(n for n in s.cache.tree.nodes() if n.host_state is HostState.COMMITTED and n.first_position <= 3 < n.end_position)
    part = s.cache.layout.part(Part.TARGET_STATE)
    host_page = int(node.host_pages[3 - node.first_position])  # type: ignore[index]
    s.cache.host_pool.layer_view(part.part, part.slot(1))[host_page, 5] ^= 0xFF
    result = s.serve(np.concatenate([x, prompt(31, 1)]), first=1)
    t = result.integrity
    assert t.mismatches == 1 and t.checked_units == t.expected_units
    m = t.examples[0]
    assert (m.request, m.position, m.part, m.layer, m.tier) == (1, 3, "target_state", 1, "l2")


@pytest.mark.parametrize("order", [Order.SHORT_FIRST, Order.FCFS])
def test_a_hit_request_goes_ahead_of_a_long_prefill(model: hf_model.HfModel, server: Any, order: Order) -> None:
    """A long prompt (three chunks) and a request whose prefix is cached (a
    3-token tail) are admitted into one batch. short-first runs the tail alone
    first, so its first token comes before the long prompt's first chunk is
    done; fcfs computes both in one forward. Outputs and bytes stay exact."""
    s = server(order=order)
    x = prompt(20, 6)
    s.serve(x)
    long, hit = prompt(21, 20), np.concatenate([x, prompt(22, 0, tail=3)])
    result = s.serve(long, hit, first=1)
    rl, rh = (next(r for r in result.records if r.request == i) for i in (1, 2))
    assert rh.l1_hit_pages == 6 and rh.computed_tokens == 1 + 3  # the last cached position, then the tail
    if order is Order.SHORT_FIRST:
        assert rh.first_forward < rl.first_forward and rh.first_token_s < rl.first_token_s
    else:
        assert rh.first_forward == rl.first_forward
    assert_outputs(model, result, {1: long, 2: hit})
    assert_clean(s, result)


def test_short_first_gives_long_work_a_forward_after_a_streak(server: Any) -> None:
    """The anti-starvation rule: after SHORT_STREAK short-only forwards in a
    row, the next forward takes the whole batch, short ones included."""
    from types import SimpleNamespace

    sched = server(order=Order.SHORT_FIRST).sched
    long, a, b = (SimpleNamespace(remaining=r) for r in (500, 9, 3))
    batch = [(long, 64), (a, 9), (b, 3)]
    for _ in range(SHORT_STREAK):
        assert sched._short_first(batch) == [(b, 3), (a, 9)]  # fewest tokens first
    assert sched._short_first(batch) == batch
    assert sched._short_first(batch) == [(b, 3), (a, 9)]  # the streak starts over
    assert sched._short_first([(a, 9), (b, 3)]) == [(a, 9), (b, 3)]  # all short: the batch as built

